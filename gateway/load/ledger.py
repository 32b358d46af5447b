"""The in-flight ledger: which requests are running on which pod, and what they consume there.

Owner: the :class:`InFlightLedger` is the one record of "request R is in flight on pod P". The request
pipeline alone writes it: :meth:`dispatch` as an attempt is sent, :meth:`finish` when that attempt ends
however it ended, and the pod-removal path calls :meth:`forget_pod`. Everything else reads it: routing
(requests per pod), pending load (consumption per pod), the workflow tracker (a workflow's or stage's
requests), session affinity (a session with a request running is never forgotten) and hard flushes
(whether anyone else is running on a pod).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Dispatch:
    """One attempt of one request on one pod."""

    request_id: str
    pod: str
    consumption: float  # the share of the pod it takes while it runs (pending load)
    kind: str
    workflow: str | None = None
    stage: str | None = None
    session: str | None = None


@dataclass(slots=True)
class PodTally:
    running: dict[Dispatch, None] = field(default_factory=dict)  # an ordered set
    consumption: float = 0.0
    embedding_consumption: float = 0.0


class InFlightLedger:
    def __init__(self) -> None:
        self._pods: dict[str, PodTally] = {}
        # ("workflow", id), ("stage", id, stage) and ("session", key) → requests in flight.
        self._owners: Counter[tuple[str, ...]] = Counter()

    # Writes (the request pipeline only)

    def dispatch(self, request_id: str, pod: str, consumption: float, kind: str, *, workflow: str | None = None,
                 stage: str | None = None, session: str | None = None) -> Dispatch:
        entry = Dispatch(request_id, pod, consumption if math.isfinite(consumption) else 1.0, kind,
                         workflow, stage, session)
        tally = self._pods.get(pod)
        if tally is None:
            tally = self._pods[pod] = PodTally()
        tally.running[entry] = None
        tally.consumption += entry.consumption
        if kind == "embeddings":
            tally.embedding_consumption += entry.consumption
        if workflow is not None or session is not None:
            for owner in _owners_of(entry):
                self._owners[owner] += 1
        return entry

    def finish(self, entry: Dispatch) -> None:
        for owner in _owners_of(entry) if entry.workflow is not None or entry.session is not None else ():
            left = self._owners[owner] - 1
            if left > 0:
                self._owners[owner] = left
            else:
                del self._owners[owner]
        tally = self._pods.get(entry.pod)
        if tally is None or entry not in tally.running:
            return  # the pod was forgotten while the request ran
        del tally.running[entry]
        # Clamp: float sums drift, and a pod with nothing in flight has no pending load.
        tally.consumption = max(0.0, tally.consumption - entry.consumption) if tally.running else 0.0
        if entry.kind == "embeddings":
            tally.embedding_consumption = (max(0.0, tally.embedding_consumption - entry.consumption)
                                           if tally.running else 0.0)

    def forget_pod(self, pod: str) -> None:
        """The pod left the fleet: its counts go (requests still running there finish quietly)."""
        self._pods.pop(pod, None)

    # Reads

    def on_pod(self, pod: str) -> int:
        tally = self._pods.get(pod)
        return len(tally.running) if tally else 0

    def consumption(self, pod: str) -> float:
        tally = self._pods.get(pod)
        return tally.consumption if tally else 0.0

    def embedding_consumption(self, pod: str) -> float:
        tally = self._pods.get(pod)
        return tally.embedding_consumption if tally else 0.0

    def of_workflow(self, workflow: str) -> int:
        return self._owners.get(("workflow", workflow), 0)

    def of_stage(self, workflow: str, stage: str) -> int:
        return self._owners.get(("stage", workflow, stage), 0)

    def of_session(self, session: str) -> int:
        return self._owners.get(("session", session), 0)

    def others_on(self, pod: str, workflow: str | None) -> bool:
        """Whether a request of another workflow (or of none) is running on ``pod``."""
        tally = self._pods.get(pod)
        return tally is not None and any(d.workflow is None or d.workflow != workflow for d in tally.running)

    def total(self) -> int:
        return sum(len(t.running) for t in self._pods.values())


def _owners_of(entry: Dispatch) -> list[tuple[str, ...]]:
    owners: list[tuple[str, ...]] = []
    if entry.workflow is not None:
        owners.append(("workflow", entry.workflow))
        if entry.stage is not None:
            owners.append(("stage", entry.workflow, entry.stage))
    if entry.session is not None:
        owners.append(("session", entry.session))
    return owners
