"""The state bus wire format: what workers and replicas tell each other, in one place.

One datagram (between the workers of one replica, over Unix sockets) or one Redis pub/sub message
(between replicas) is one msgpack ``Batch``::

    [origin, replica, [fact, fact, ...]]

``origin`` names the sending process (``<replica>/w<index>/<pid>``: a restarted worker is a new origin,
so nothing of its previous life stays counted). ``replica`` lets a worker ignore, on Redis, what its own
siblings already sent it directly. Each fact is a positional array tagged by its first element, and
reports one change its sender's owner made; the receiver's owner applies it as a remote change. A batch
with no facts is a heartbeat.
"""

from __future__ import annotations

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


AnyFact = (OwnersChanged | OwnersSnapshot | SessionPinned | BlocksExpected | ContextHeld | ContextIdled
           | ContextReleased | StageBegan | StageDispatched | StageFinished | WorkflowCompleted | PreserveDropped)


class Batch(msgspec.Struct, array_like=True):
    origin: str
    replica: str
    facts: list[AnyFact]


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Batch)
