"""Wires the owners of shared state to the state bus: where each owner publishes its own changes (the sink
it is built with, :class:`Sinks`), and the one ``apply_remote`` method through which it takes the changes of
other workers and replicas (:func:`replicate`).

What is shared (``shared_state.share``):

- ``workflows``: the workflow tracker's stages, dispatches, finishes and completions;
- ``sessions``: session pins, and the targets of model splits pinned to sticky keys;
- ``contexts``: the resumable working set's holds, idles and releases (what placement weighs);
- ``speculative``: the prefix index's just-routed blocks;
- ``flows``: flow control's service counters (charges and lifts) and the flow each workflow began with;
- ``adapters``: which LoRA adapters each pod served lately (what stays resident, and what idles);
- ``limits``: the tokens and requests in flight of each API key and tenant with limits (each heartbeat
  carries a process's own whole);
- with any of the first three, the in-flight ledger's per-context and per-stage counts, the one count of
  requests in flight that the tracker, the session map and the working set all read.

Owner: nothing of its own; each owner keeps its state, and the bus its links.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.cluster.bus import StateBus
from gateway.core.facts import (
    AdapterServed,
    BlocksExpected,
    ContextHeld,
    ContextIdled,
    ContextReleased,
    OwnersChanged,
    OwnersSnapshot,
    PreserveDropped,
    Publish,
    ScopeRequests,
    ServiceCharged,
    ServiceLifted,
    SessionPinned,
    SplitPinned,
    StageBegan,
    StageDispatched,
    StageFinished,
    UsageCharged,
    UsageSnapshot,
    WorkflowCompleted,
    WorkflowFlow,
    unshared,
)
from gateway.flow.service_counters import ServiceCounters, WorkflowFlows
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.limits.shared import SharedUsage
from gateway.load.ledger import InFlightLedger
from gateway.models.adapters import AdapterUse
from gateway.models.rules import ModelRules
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import WorkflowTracker

_COUNTED = {"workflows", "sessions", "contexts"}  # what reads the ledger's per-context counts


@dataclass(frozen=True, slots=True)
class Sinks:
    """Where each owner puts the facts of its own changes: the bus, or nowhere when it is not shared."""

    ledger: Publish = unshared
    tracker: Publish = unshared
    sessions: Publish = unshared
    working_set: Publish = unshared
    index: Publish = unshared
    flows: Publish = unshared
    models: Publish = unshared
    adapters: Publish = unshared
    limits: Publish = unshared

    @classmethod
    def of(cls, bus: StateBus) -> Sinks:
        share = set(bus.config.share) if bus.active else set()

        def sink(shared: bool) -> Publish:
            return bus.publish if shared else unshared

        return cls(ledger=sink(bool(share & _COUNTED)), tracker=sink("workflows" in share),
                   sessions=sink("sessions" in share), working_set=sink("contexts" in share),
                   index=sink("speculative" in share), flows=sink("flows" in share),
                   models=sink("sessions" in share), adapters=sink("adapters" in share),
                   limits=sink("limits" in share))


def replicate(bus: StateBus, ledger: InFlightLedger, tracker: WorkflowTracker, sessions: SessionAffinity,
              working_set: ResumableWorkingSet, index: PrefixIndex, service: ServiceCounters,
              workflow_flows: WorkflowFlows, rules: ModelRules | None = None,
              adapters: AdapterUse | None = None, usage: SharedUsage | None = None) -> None:
    """Apply the facts of the other processes to the owners whose state is shared."""
    if not bus.active:
        return
    share = set(bus.config.share)
    if share & _COUNTED:
        bus.on((OwnersChanged, OwnersSnapshot), ledger.apply_remote)
        bus.heartbeat_with(ledger.snapshot)
        bus.on_peer_gone(ledger.forget_origin)
        # The working set reads the shared counts: a context whose last request ended elsewhere (or in a
        # process gone silent, or whose end was in a lost batch) idles at the next snapshot.
        bus.on((OwnersSnapshot,), lambda origin, fact: working_set.settle(time.monotonic()))
        bus.on_peer_gone(lambda origin: working_set.settle(time.monotonic()))
    if "workflows" in share:
        bus.on((StageBegan, StageDispatched, StageFinished, WorkflowCompleted, PreserveDropped),
               tracker.apply_remote)
    if "sessions" in share:
        bus.on((SessionPinned,), sessions.apply_remote)
        if rules is not None:
            bus.on((SplitPinned,), rules.apply_remote)
    if "contexts" in share:
        bus.on((ContextHeld, ContextIdled, ContextReleased), working_set.apply_remote)
    if "speculative" in share:
        bus.on((BlocksExpected,), index.apply_remote)
    if "flows" in share:
        bus.on((ServiceCharged, ServiceLifted), service.apply_remote)
        bus.on((WorkflowFlow,), workflow_flows.apply_remote)
    if "adapters" in share and adapters is not None:
        bus.on((AdapterServed,), adapters.apply_remote)
    if "limits" in share and usage is not None:
        bus.on((UsageCharged, ScopeRequests, UsageSnapshot), usage.apply_remote)
        bus.heartbeat_with(usage.snapshot)
        bus.on_peer_gone(usage.forget_origin)
