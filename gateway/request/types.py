"""What the director hands the steps of the pipeline: one typed, read-only view per extension point.

- :class:`ClientRequest`: what the client sent (prepare, admit, plan);
- :class:`Attempt`: one try on one pod (dispatch, finish);
- :class:`CompletedRequest`: how the request ended (complete).

Owner: the director builds each of them once; steps read them and return their own results (token ids
and load estimates go into the routing view, :class:`~gateway.routing.policy.RoutingRequest`, whose
fields each name their one writer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.admission import Slo
from gateway.auth import ApiKey
from gateway.core.requests import InferenceRequest
from gateway.load.ledger import Dispatch
from gateway.proxy.outcome import RelayOutcome
from gateway.routing.policy import Decision, Policy, RoutingRequest
from gateway.workflow.service import RequestPlan


@dataclass(eq=False, slots=True, frozen=True)
class ClientRequest:
    http: web.Request
    id: str
    # The API path family: "chat", "completions", "responses", "embeddings", "messages", "count_tokens".
    kind: str
    started: float  # monotonic
    body: bytes  # as received, decoded from its content-encoding: forwarded as it is
    parsed: InferenceRequest
    key: ApiKey | None  # the gateway API key it came with, when keys are on
    headers: CIMultiDictProxy[str] = field(init=False)
    model: str = field(init=False)  # "" until the body is understood

    def __post_init__(self) -> None:
        object.__setattr__(self, "headers", self.http.headers)
        object.__setattr__(self, "model", self.parsed.model or "")


@dataclass(frozen=True, slots=True)
class Admitted:
    """What admission decided: the request's SLO, and how long it queued for capacity."""

    slo: Slo
    queued_s: float = 0.0


@dataclass(eq=False, slots=True, frozen=True)
class Attempt:
    request: ClientRequest
    policy: Policy
    routing: RoutingRequest
    plan: RequestPlan
    decision: Decision
    dispatch: Dispatch  # the ledger's record of this attempt
    number: int  # 0 for the first try
    routing_started: float  # monotonic, when the router began this decision
    # Sent to the pod; a dispatch step may add to it (the trace context).
    upstream_headers: dict[str, str]


@dataclass(eq=False, slots=True, frozen=True)
class CompletedRequest:
    request: ClientRequest
    status: int  # the truth: a stream cut mid-way is not a 200
    finished: float  # monotonic
    attempts: int
    routing: RoutingRequest | None = None  # None: refused before routing
    admitted: Admitted | None = None
    last: Attempt | None = None
    outcome: RelayOutcome | None = None  # of the last attempt, when it relayed anything

    @property
    def model(self) -> str:
        return self.request.model or "-"

    @property
    def decision(self) -> Decision | None:
        return self.last.decision if self.last is not None else None

    @property
    def first_byte_s(self) -> float | None:
        at = self.outcome.first_byte_at if self.outcome is not None else None
        return at - self.request.started if at is not None else None
