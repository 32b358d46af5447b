"""Facts: the changes an owner of shared state makes, as it tells the other workers and replicas.

Each fact reports one change its sender's owner made (a request of a workflow began, a context was held
on a pod, ...); the receiver's owner applies it as a remote change. Owners emit them through the sink they
are built with (:mod:`gateway.cluster.replication` makes those sinks) and apply the others' in one
``apply_remote`` method each. Each fact is a positional msgpack array tagged by its first element; a batch of
them is the state bus's datagram (:mod:`gateway.cluster.wire`).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec


class Fact(msgspec.Struct, array_like=True, tag=True):
    pass


# The in-flight ledger: requests of these workflows, stages and sessions began (+1) or ended (-1).
class OwnersChanged(Fact):
    owners: list[list[str]]
    delta: int


# The in-flight ledger, every heartbeat: all owners with requests in flight here, replacing what came before.
class OwnersSnapshot(Fact):
    owners: list[list[str]]
    counts: list[int]


# Session affinity: the session now sticks to the pod.
class SessionPinned(Fact):
    key: str
    pod: str


# The prefix index: these blocks will soon be on the pod (speculative, until its events say so).
class BlocksExpected(Fact):
    pod: str
    hashes: list[int]


# The resumable working set: a request of the context was routed, one ended, the context was let go.
class ContextHeld(Fact):
    key: str
    keyed: bool
    pod: str
    block_size: int
    hashes: list[int]
    prompt_tokens: int
    retention_s: float | None = None
    # The prompt of the request that holds it grew (it was held with its head while the rest was tokenized):
    # the same hold, its blocks now the whole prompt's.
    grown: bool = False


class ContextIdled(Fact):
    key: str


class ContextReleased(Fact):
    key: str
    completed: bool


# The workflow tracker: a stage began, was dispatched, finished; a workflow completed; a preserve ended.
class StageBegan(Fact):
    workflow: str
    stage: str
    model: str
    prompt_tokens: int
    complete: bool
    # The stage it followed where it began: facts from two senders may arrive in either order.
    after: str | None = None


class StageDispatched(Fact):
    workflow: str
    stage: str
    pod: str
    model: str
    action: str  # the plan's action kind (noop, preserve, flush)
    action_pod: str | None


class StageFinished(Fact):
    workflow: str
    stage: str
    pod: str
    prompt_tokens: int | None


class WorkflowCompleted(Fact):
    workflow: str


class PreserveDropped(Fact):
    pod: str
    workflow: str | None


# Flow control: the weighted service a flow received (tokens its requests were served), a flow's service
# raised to a floor (it became backlogged behind others), and the flow a workflow's stages inherit.
class ServiceCharged(Fact):
    fairness_id: str
    priority: int
    amount: float


class ServiceLifted(Fact):
    fairness_id: str
    priority: int
    floor: float


class WorkflowFlow(Fact):
    workflow: str
    fairness_id: str
    priority: int


# Model rules: a split's sticky key (a workflow, session, conversation or response) was given this target.
class SplitPinned(Fact):
    key: str
    public: str
    target: str


# LoRA adapters: the pod served a request of the adapter (sent at most every few seconds per pod and adapter).
class AdapterServed(Fact):
    pod: str
    adapter: str


# Key and tenant limits: tokens a scope (``key:<name>``, ``tenant:<id>``) used in a wall-clock minute (a
# correction may be negative) and the requests it began then, its requests in flight began (+1) or ended
# (-1), and every heartbeat a process's own counts whole (minutes and days: (scope, index, input, output);
# ``requests``: each minute's requests begun, in the order of ``minutes``), replacing what came before.
# ``sent``: the charging process's wall clock (0: not said), from which the others learn how late they hear
# of a charge. Fields added later come last, with a default: a process of the previous version ignores them.
class UsageCharged(Fact):
    scope: str
    minute: int
    input_tokens: int
    output_tokens: int
    sent: float = 0.0
    requests: int = 0


class ScopeRequests(Fact):
    scope: str
    delta: int


class UsageSnapshot(Fact):
    minutes: list[tuple[str, int, int, int]]
    days: list[tuple[str, int, int, int]]
    scopes: list[str]
    in_flight: list[int]
    requests: list[int] = []


# Not state: a wake-up call to the workers of one replica, sent at once, when room frees up on a pod while
# they hold requests (``gateway/flow/release_order.py``).
class RoomFreed(Fact):
    pass


AnyFact = (OwnersChanged | OwnersSnapshot | SessionPinned | BlocksExpected | ContextHeld | ContextIdled
           | ContextReleased | StageBegan | StageDispatched | StageFinished | WorkflowCompleted | PreserveDropped
           | ServiceCharged | ServiceLifted | WorkflowFlow | SplitPinned | AdapterServed | UsageCharged | ScopeRequests
           | UsageSnapshot | RoomFreed)


# Where an owner puts the facts about its own changes: the state bus, or nowhere when nothing is shared.
Publish = Callable[[Fact], None]


def unshared(fact: Fact) -> None:
    """The sink of an owner whose state is not shared."""
