"""Wires the owners of shared state to the state bus: each owner publishes its own changes, and applies the
changes of other workers and replicas through one handler per kind of fact.

What is shared (``shared_state.share``):

- ``workflows``: the workflow tracker's stages, dispatches, finishes and completions, and the in-flight
  ledger's per-workflow and per-stage counts;
- ``sessions``: session pins, and the ledger's per-session counts;
- ``contexts``: the resumable working set's holds, idles and releases (what placement weighs);
- ``speculative``: the prefix index's just-routed blocks.

Owner: :class:`Replication` owns one record of its own, the contexts each other process holds (so that
those of a process gone silent are idled); everything else stays with its owner.
"""

from __future__ import annotations

from collections import Counter

from gateway.cluster.bus import StateBus
from gateway.cluster.facts import (
    BlocksExpected,
    ContextHeld,
    ContextIdled,
    ContextReleased,
    OwnersChanged,
    OwnersSnapshot,
    PreserveDropped,
    SessionPinned,
    StageBegan,
    StageDispatched,
    StageFinished,
    WorkflowCompleted,
)
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import WorkflowTracker


class Replication:
    def __init__(self, bus: StateBus, ledger: InFlightLedger, tracker: WorkflowTracker, sessions: SessionAffinity,
                 working_set: ResumableWorkingSet, index: PrefixIndex) -> None:
        self._working_set = working_set
        # origin → key → requests of that context it has in flight
        self._held: dict[str, Counter[str]] = {}
        if not bus.active:
            return
        share = set(bus.config.share)
        if share & {"workflows", "sessions"}:
            ledger.publish = bus.publish
            bus.on(OwnersChanged, ledger.apply_changed)
            bus.on(OwnersSnapshot, ledger.apply_snapshot)
            bus.heartbeat_with(ledger.snapshot)
            bus.on_peer_gone(ledger.forget_origin)
        if "workflows" in share:
            tracker.publish = bus.publish
            bus.on(StageBegan, tracker.apply_began)
            bus.on(StageDispatched, tracker.apply_dispatched)
            bus.on(StageFinished, tracker.apply_finished)
            bus.on(WorkflowCompleted, tracker.apply_completed)
            bus.on(PreserveDropped, tracker.apply_preserve_dropped)
        if "sessions" in share:
            sessions.publish = bus.publish
            bus.on(SessionPinned, sessions.apply_pinned)
        if "contexts" in share:
            working_set.publish = bus.publish
            bus.on(ContextHeld, self._context_held)
            bus.on(ContextIdled, self._context_idled)
            bus.on(ContextReleased, working_set.apply_released)
            bus.on_peer_gone(self._idle_contexts_of)
        if "speculative" in share:
            index.publish = bus.publish
            bus.on(BlocksExpected, index.apply_expected)

    def _context_held(self, origin: str, fact: ContextHeld) -> None:
        self._held.setdefault(origin, Counter())[fact.key] += 1
        self._working_set.apply_held(origin, fact)

    def _context_idled(self, origin: str, fact: ContextIdled) -> None:
        held = self._held.get(origin)
        if held is not None and held[fact.key] > 0:
            held[fact.key] -= 1
            if not held[fact.key]:
                del held[fact.key]
        self._working_set.apply_idled(origin, fact)

    def _idle_contexts_of(self, origin: str) -> None:
        """A process went silent with requests in flight: they will not end on their own here."""
        for key, n in self._held.pop(origin, Counter()).items():
            for _ in range(n):
                self._working_set.apply_idled(origin, ContextIdled(key))

    def debug(self) -> dict[str, int]:
        return {origin: sum(held.values()) for origin, held in self._held.items()}
