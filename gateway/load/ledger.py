"""The in-flight ledger: which requests are running on which pod, and what they consume there.

Owner: the :class:`InFlightLedger` is the one record of "request R is in flight on pod P". The request
director and its prefill legs alone write it: :meth:`dispatch` as an attempt (or a prefill leg) is sent,
:meth:`answering` when the pod's answer begins (its prompt is prefilled), :meth:`finish` when it ends
however it ended; the pod-removal path calls :meth:`forget_pod`. Everything else reads it: routing
(requests per pod), pending load (consumption per pod), flow control (the prompt tokens each pod has yet
to prefill: :meth:`prefill_backlog`, and how much of that work remains: :meth:`prefill_remaining`), the
working set (a context's requests: the one count of them), the
workflow tracker (a workflow's or stage's requests), session affinity (a session with a request running is
never forgotten) and hard flushes (whether anyone else is running on a pod). With several workers
(``serve --workers N``) the ledger also writes this worker's cell of the shared load table, and the per-pod
reads (:meth:`on_pod`, :meth:`consumption`, :meth:`embedding_consumption`, :meth:`prefill_backlog`) sum
every worker's. Whatever frees a pod (an answer begins, an attempt ends) rings the ``freed`` bell it is
built with (flow control listens). The per-owner counts (context, stage) of the other workers and
replicas come over the state bus (:meth:`apply_remote`), one tally per origin so that a vanished one can
be dropped (:meth:`forget_origin`); this ledger's own changes go out through the sink it is built with.

Prefill progress: a pod prefills its backlog first come, first served, at a rate the ledger measures (the
prompt tokens of each answer that begins over the time since the pod last made progress: that answer's
dispatch, or the previous one's first byte). Between first bytes the remaining work is the backlog less
what that rate got through since the last progress, never more than the backlog was then (what came later
waits behind it). Flow control releases the next prompt as the remaining work drains, so that it reaches
the pod before the running prefill ends and the pod does not idle between prompts. With several workers the
last progress any of them saw is read from the shared table; each worker measures the rate from its own.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.core.contexts import session_key, workflow_key
from gateway.core.facts import OwnersChanged, OwnersSnapshot, Publish, unshared
from gateway.core.inference_api import RequestKind
from gateway.load.shared_table import SharedLoadTable


@dataclass(eq=False, slots=True)
class Dispatch:
    """One attempt of one request on one pod."""

    request_id: str
    pod: str
    consumption: float  # the share of the pod it takes while it runs (pending load)
    kind: RequestKind
    context: str | None = None  # the workflow, session or conversation it continues
    stage: tuple[str, str] | None = None  # (workflow id, stage id)
    # Prompt tokens the pod has to prefill (less those predicted cached), until its answer begins.
    prefill_tokens: int = 0
    sent_at: float = 0.0  # when it was sent (monotonic; set when it has prompt tokens to prefill)
    # The pod's requests in flight just before this one was dispatched to it (what placement chose it with).
    in_flight_before: int = 0


class PrefillRate:
    """Prompt tokens a pod prefills per second, over its recent answers (sums that fade by ``KEEP`` per answer:
    prompts prefilled together in one batch come out as their sum over the time they took together)."""

    KEEP = 0.8
    __slots__ = ("_seconds", "_tokens")

    def __init__(self) -> None:
        self._tokens = self._seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self._tokens = self._tokens * self.KEEP + tokens
        self._seconds = self._seconds * self.KEEP + seconds

    def get(self) -> float | None:
        return self._tokens / self._seconds if self._seconds > 0 else None


@dataclass(slots=True)
class PodTally:
    running: dict[Dispatch, None] = field(default_factory=dict)  # an ordered set
    consumption: float = 0.0
    embedding_consumption: float = 0.0
    prefill_tokens: int = 0
    # The last prefill progress this worker saw on the pod (None: none yet) and the backlog right after it.
    progress_at: float | None = None
    progressed: int = 0
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)


OwnerKey = tuple[str, ...]


class InFlightLedger:
    def __init__(self, shared: SharedLoadTable | None = None, publish: Publish = unshared,
                 freed: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        self._pods: dict[str, PodTally] = {}
        # ("context", key) and ("stage", workflow, stage) → requests in flight, here and (``_remote``, per
        # origin) on the other workers and replicas.
        self._owners: Counter[OwnerKey] = Counter()
        self._remote: dict[str, Counter[OwnerKey]] = {}
        self._shared = shared
        self._publish = publish
        self._freed = freed
        self._clock = clock

    # Writes (the request pipeline only)

    def dispatch(self, request_id: str, pod: str, consumption: float, kind: RequestKind, *, context: str | None = None,
                 stage: tuple[str, str] | None = None, prefill_tokens: int = 0) -> Dispatch:
        entry = Dispatch(request_id, pod, consumption if math.isfinite(consumption) else 1.0, kind, context, stage,
                         max(0, prefill_tokens), in_flight_before=self.on_pod(pod))
        tally = self._pods.get(pod)
        if tally is None:
            tally = self._pods[pod] = PodTally()
        idle = entry.prefill_tokens > 0 and not self.prefill_backlog(pod)
        tally.running[entry] = None
        tally.consumption += entry.consumption
        tally.prefill_tokens += entry.prefill_tokens
        if entry.prefill_tokens:
            entry.sent_at = self._clock()
        if kind == RequestKind.EMBEDDINGS:
            tally.embedding_consumption += entry.consumption
        if context is not None or stage is not None:
            owners = _owners_of(entry)
            for owner in owners:
                self._owners[owner] += 1
            self._publish(OwnersChanged([list(o) for o in owners], 1))
        self._share(pod, tally)
        if idle:  # the pod begins on it at once
            self._progressed(pod, tally, entry.sent_at)
        return entry

    def answering(self, entry: Dispatch) -> None:
        """The pod began answering ``entry``: its prompt is prefilled."""
        tally = self._pods.get(entry.pod)
        if not entry.prefill_tokens or tally is None or entry not in tally.running:
            return
        now = self._clock()
        last = self._last_progress(entry.pod)
        since = max(entry.sent_at, last[0]) if last is not None else entry.sent_at
        if now > since:
            tally.prefill_rate.add(entry.prefill_tokens, now - since)
        tally.prefill_tokens = max(0, tally.prefill_tokens - entry.prefill_tokens)
        entry.prefill_tokens = 0
        self._share(entry.pod, tally)
        self._progressed(entry.pod, tally, now)
        self._freed()

    def finish(self, entry: Dispatch) -> None:
        if entry.context is not None or entry.stage is not None:
            owners = _owners_of(entry)
            _count_down(self._owners, owners, 1)
            self._publish(OwnersChanged([list(o) for o in owners], -1))
        tally = self._pods.get(entry.pod)
        if tally is None or entry not in tally.running:
            return  # the pod was forgotten while the request ran
        del tally.running[entry]
        tally.prefill_tokens = max(0, tally.prefill_tokens - entry.prefill_tokens) if tally.running else 0
        # Clamp: float sums drift, and a pod with nothing in flight has no pending load.
        tally.consumption = max(0.0, tally.consumption - entry.consumption) if tally.running else 0.0
        if entry.kind == RequestKind.EMBEDDINGS:
            tally.embedding_consumption = (max(0.0, tally.embedding_consumption - entry.consumption)
                                           if tally.running else 0.0)
        self._share(entry.pod, tally)
        self._freed()

    def _share(self, pod: str, tally: PodTally) -> None:
        if self._shared is not None:
            self._shared.write(pod, len(tally.running), tally.consumption, tally.embedding_consumption,
                               tally.prefill_tokens)

    def _progressed(self, pod: str, tally: PodTally, at: float) -> None:
        """The pod made prefill progress ``at`` (began on its next prompt)."""
        tally.progress_at, tally.progressed = at, self.prefill_backlog(pod)
        if self._shared is not None:
            self._shared.write_progress(pod, at, tally.progressed)

    def _last_progress(self, pod: str) -> tuple[float, int] | None:
        """The pod's latest prefill progress (any worker's) and the backlog right after it; None: none yet."""
        if self._shared is not None and (shared := self._shared.progress(pod)) is not None:
            return shared if shared[0] > 0 else None
        tally = self._pods.get(pod)
        return (tally.progress_at, tally.progressed) if tally is not None and tally.progress_at is not None else None

    def forget_pod(self, pod: str) -> None:
        """The pod left the fleet: its counts go (requests still running there finish quietly)."""
        self._pods.pop(pod, None)
        if self._shared is not None:
            self._shared.release(pod)

    def apply_remote(self, origin: str, fact: OwnersChanged | OwnersSnapshot) -> None:
        """Another worker or replica dispatched (+1) or finished (-1) a request of these owners, or (every
        heartbeat) sent all its counts, which replace what came before."""
        if isinstance(fact, OwnersSnapshot):
            self._remote[origin] = Counter({tuple(o): n for o, n in zip(fact.owners, fact.counts, strict=True)})
            return
        counts = self._remote.setdefault(origin, Counter())
        owners = [tuple(o) for o in fact.owners]
        if fact.delta > 0:
            for owner in owners:
                counts[owner] += fact.delta
        else:
            _count_down(counts, owners, -fact.delta)

    def snapshot(self) -> OwnersSnapshot:
        return OwnersSnapshot([list(o) for o in self._owners], list(self._owners.values()))

    def forget_origin(self, origin: str) -> None:
        """That worker or replica is gone: none of its requests is in flight any more."""
        self._remote.pop(origin, None)

    # Reads

    def on_pod(self, pod: str) -> int:
        if self._shared is not None and (shared := self._shared.in_flight(pod)) is not None:
            return shared
        tally = self._pods.get(pod)
        return len(tally.running) if tally else 0

    def consumption(self, pod: str) -> float:
        if self._shared is not None and (shared := self._shared.consumption(pod)) is not None:
            return max(0.0, shared)
        tally = self._pods.get(pod)
        return tally.consumption if tally else 0.0

    def prefill_backlog(self, pod: str) -> int:
        """Prompt tokens sent to ``pod`` (by every worker) that it has not begun answering."""
        if self._shared is not None and (shared := self._shared.prefill(pod)) is not None:
            return max(0, shared)
        tally = self._pods.get(pod)
        return tally.prefill_tokens if tally else 0

    def prefill_rate(self, pod: str) -> float | None:
        """Prompt tokens per second the pod prefilled lately, as this worker measured it (None: not yet)."""
        tally = self._pods.get(pod)
        return tally.prefill_rate.get() if tally is not None else None

    def prefill_remaining(self, pod: str, now: float) -> float:
        """Prompt tokens ``pod`` has yet to prefill: its backlog, less what its rate got through since its last
        progress (no more than its backlog was then)."""
        return _remaining(now, *self._prefill_state(pod))

    def prefill_below_in(self, pod: str, tokens: float, now: float) -> float | None:
        """Seconds until ``pod``'s remaining prefill work is below ``tokens`` (0: it is; None: not before an
        answer of its begins)."""
        backlog, rate, last = self._prefill_state(pod)
        remaining = _remaining(now, backlog, rate, last)
        if remaining < tokens:
            return 0.0
        if rate is None or last is None or backlog - last[1] >= tokens:
            return None  # what came after the last progress is enough on its own
        return (remaining - tokens) / rate + 1e-3

    def _prefill_state(self, pod: str) -> tuple[int, float | None, tuple[float, int] | None]:
        """The pod's backlog, and (only where they count: a backlog, a rate) its rate and last progress."""
        backlog = self.prefill_backlog(pod)
        rate = self.prefill_rate(pod) if backlog else None
        return backlog, rate, self._last_progress(pod) if rate else None

    def embedding_consumption(self, pod: str) -> float:
        if self._shared is not None and (shared := self._shared.embedding(pod)) is not None:
            return max(0.0, shared)
        tally = self._pods.get(pod)
        return tally.embedding_consumption if tally else 0.0

    def _owned(self, owner: OwnerKey) -> int:
        n = self._owners.get(owner, 0)
        for counts in self._remote.values():
            n += counts.get(owner, 0)
        return n

    def of_context(self, key: str) -> int:
        """Requests of the context in flight, here and on the other workers and replicas."""
        return self._owned(("context", key))

    def of_workflow(self, workflow: str) -> int:
        return self._owned(("context", workflow_key(workflow)))

    def of_stage(self, workflow: str, stage: str) -> int:
        return self._owned(("stage", workflow, stage))

    def of_session(self, session: str) -> int:
        return self._owned(("context", session_key(session)))

    def others_on(self, pod: str, workflow: str | None) -> bool:
        """Whether a request of another workflow (or of none) is running on ``pod``."""
        tally = self._pods.get(pod)
        own = workflow_key(workflow) if workflow is not None else None
        return tally is not None and any(d.context is None or d.context != own for d in tally.running)

    def remote_debug(self) -> dict[str, int]:
        """Per other worker or replica, its requests of contexts in flight, as last heard."""
        return {origin: sum(n for owner, n in counts.items() if owner[0] == "context")
                for origin, counts in self._remote.items()}

    def total(self) -> int:
        """Requests this process has in flight."""
        return sum(len(t.running) for t in self._pods.values())


def _count_down(counts: Counter[OwnerKey], owners: list[OwnerKey], n: int) -> None:
    for owner in owners:
        left = counts[owner] - n
        if left > 0:
            counts[owner] = left
        else:
            counts.pop(owner, None)  # a remote finish may come without its dispatch (joined late)


def _remaining(now: float, backlog: int, rate: float | None, last: tuple[float, int] | None) -> float:
    if last is None or rate is None:
        return float(backlog)
    at, progressed = last
    return max(0.0, backlog - min(rate * max(0.0, now - at), progressed))


def _owners_of(entry: Dispatch) -> list[OwnerKey]:
    owners: list[OwnerKey] = []
    if entry.context is not None:
        owners.append(("context", entry.context))
    if entry.stage is not None:
        owners.append(("stage", *entry.stage))
    return owners
