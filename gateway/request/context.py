"""What one client request carries through the pipeline.

Each field is written by the one stage named beside it; the others read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.admission import Slo
from gateway.api.requests import InferenceRequest
from gateway.api.usage import Usage
from gateway.load.ledger import Dispatch
from gateway.routing.policy import Decision, Policy, RoutingRequest
from gateway.workflow.service import NO_PLAN, RequestPlan

if TYPE_CHECKING:
    from gateway.tracing import RequestSpans


@dataclass(slots=True)
class RequestContext:
    http: web.Request
    request_id: str
    # The API path family: "chat", "completions", "responses", "embeddings".
    kind: str
    started: float
    # The director: the body as received (forwarded unchanged), parsed, and the routing view of it.
    body: bytes = b""
    parsed: InferenceRequest | None = None
    model: str = "-"
    base_model: str = "-"
    policy: Policy | None = None
    routing: RoutingRequest | None = None
    upstream_headers: dict[str, str] = field(default_factory=dict)
    # Admission: the request's SLO, and how long it queued for capacity.
    slo: Slo | None = None
    queued_s: float = 0.0
    # Tokenization, for a model whose predictions drift: the prompt's length by the local tokenizer.
    probe_tokens: int | None = None
    # The workflow planner: cache action and pin.
    workflow: RequestPlan = field(default_factory=lambda: NO_PLAN)
    # The director, per attempt: the decision and the ledger's record of the attempt.
    decision: Decision | None = None
    dispatch: Dispatch | None = None
    attempts: int = 0
    # The tracing steps (only with tracing on): the request's open spans.
    trace: RequestSpans | None = None
    # The proxy, as it relays the answer.
    status: int = 0
    first_byte_at: float | None = None
    usage: Usage | None = None
    streamed_events: int = 0

    @property
    def predicted_output_tokens(self) -> int:
        return self.routing.predicted_output_tokens if self.routing is not None else 0

    @property
    def prompt_tokens(self) -> int:
        """The prompt's token count, exact when tokenized, else about four bytes of body per token."""
        if self.routing is not None and self.routing.token_ids:
            return len(self.routing.token_ids)
        return len(self.body) // 4
