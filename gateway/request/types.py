"""What the director hands the steps of the pipeline: one typed, read-only view per extension point.

- :class:`ClientRequest`: what the client sent, as the resolve steps made it (prepare, admit, plan);
- :class:`Attempt`: one try on one pod (dispatch, finish);
- :class:`CompletedRequest`: how the request ended (complete), with its :class:`PrefillLeg` when its
  model is disaggregated (prefill and decode on two pods).

Owner: the director builds each of them once; steps read them and return their own results (token ids
and load estimates go into the routing view, :class:`~gateway.routing.policy.RoutingRequest`, whose
fields each name their one writer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.admission import Slo
from gateway.auth import ApiKey
from gateway.core.inference_api import InferenceRequest, RequestKind
from gateway.core.usage import Usage
from gateway.flow.flows import FlowKey
from gateway.load.ledger import Dispatch
from gateway.models.rules import ModelRoute
from gateway.pods.registry import Pod
from gateway.proxy.outcome import AnswerTap, Ending, RelayOutcome
from gateway.request.timings import StepTimes
from gateway.routing.policy import Decision, Policy, RoutingRequest
from gateway.workflow.planning import RequestPlan

# A request's headers as the client sent them, looked up case-insensitively (whichever edge received them).
Headers = CIMultiDictProxy[str] | CIMultiDict[str]


@dataclass(eq=False, slots=True, frozen=True)
class ClientRequest:
    """What the client sent, whichever edge received it (the HTTP proxy, or Envoy through the EPP)."""

    id: str
    kind: RequestKind
    started: float  # monotonic
    body: bytes  # as received, decoded from its content-encoding
    parsed: InferenceRequest
    key: ApiKey | None  # the gateway API key it came with, when keys are on
    headers: Headers
    method: str
    path: str  # with its query string, as sent upstream
    # A resolve step's: the one pod that may serve it (the pod that keeps the state it continues), and what
    # reads the pod's answer as it passes (the Responses API's store).
    only_pod: str | None = None
    answer_tap: AnswerTap | None = None
    model: str = field(init=False)  # "" until the body is understood

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", self.parsed.model or "")

    def prompt_tokens(self, routing: RoutingRequest | None) -> int:
        """The prompt's length in tokens: exact once tokenized (one routed on its head: the head's, and the
        rest's estimate), else guessed from the body (4 bytes a token)."""
        if routing is None or not routing.token_ids:
            return max(1, len(self.body) // 4)
        return len(routing.token_ids) + routing.untokenized_tokens


# Where a pod that orders its own queue by priority reads a request's (vLLM 0.32: before the body's
# ``priority`` field; lower values first), on every API it serves, Anthropic's included.
ENGINE_PRIORITY_HEADER = "x-vllm-priority"


@dataclass(frozen=True, slots=True)
class Admitted:
    """What admission decided: the request's SLO, how long it waited at the gateway, its flow (fairness id
    and band) and objective, and the priority a pod that schedules by priority is to give it (applied by
    whichever edge sends the attempt, to such pods only: :data:`ENGINE_PRIORITY_HEADER`)."""

    slo: Slo
    queued_s: float = 0.0
    flow: FlowKey | None = None
    objective: str | None = None
    engine_priority: int | None = None


@dataclass(eq=False, slots=True, frozen=True)
class Attempt:
    request: ClientRequest
    policy: Policy
    routing: RoutingRequest
    plan: RequestPlan
    decision: Decision
    dispatch: Dispatch  # the ledger's record of this attempt
    number: int  # 0 for the first try
    routing_started: float  # monotonic, when this attempt's routing began (a prefill leg: once routed)
    # Sent to the pod; a dispatch step may add to it (the trace context).
    upstream_headers: dict[str, str]
    # The body sent when it is not the client's: its model rewritten for the target (gateway.models.rules).
    body: bytes | None = None
    # Dispatched on its prompt's head, this many tokens of it (the rest is tokenized when the attempt ends:
    # gateway.request.steps.PromptTokenization); None: on the whole prompt, or on none.
    head_tokens: int | None = None

    @property
    def sent_body(self) -> bytes:
        return self.body if self.body is not None else self.request.body


class Split(enum.Enum):
    """What became of a disaggregated request's prefill leg (``gateway_pd_requests_total{outcome}``)."""

    SPLIT = "split"  # a prefill pod prefilled it, the decode pod decoded it
    CACHED = "cached"  # the decode pod holds all but a few of its tokens: it prefills them itself
    SHORT = "short"  # a prompt that short is prefilled by the decode pod itself
    NO_PREFILL_POD = "no_prefill_pod"  # no prefill pod could take it: served whole by the decode pod
    PREFILL_FAILED = "prefill_failed"  # every prefill pod tried failed or timed out: served whole
    PREFILL_REFUSED = "prefill_refused"  # the prefill pod refused it (4xx): the decode pod answers it whole
    UNSUPPORTED = "unsupported"  # an API or shape not split (responses, several prompts): served whole


@dataclass(eq=False, slots=True, frozen=True)
class PrefillLeg:
    """How a disaggregated request's prefill leg went, for one decode attempt."""

    outcome: Split
    decision: Decision | None = None  # where the prefill leg was served (split only)
    # The prefill leg's own routing view (its prefix match over the prefill pods), when one was routed.
    routing: RoutingRequest | None = None
    usage: Usage | None = None  # of the prefill pod's answer (split only)
    seconds: float = 0.0  # the leg's time, every try included
    tries: int = 0
    # NIXL: the client's body with the prefill pod's ``kv_transfer_params``, sent to the decode pod instead.
    decode_body: bytes | None = None

    @property
    def pod(self) -> Pod | None:
        return self.decision.pod if self.decision is not None else None


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
    prefill: PrefillLeg | None = None  # the last attempt's prefill leg (disaggregated models only)
    steps: StepTimes | None = None  # the time of each step it reached (gateway.request.timings)
    # What its model name meant: the targets tried in order (the routing view's model is the last one).
    route: ModelRoute | None = None
    # (target, why) of each target that could not serve it before the last one.
    fallbacks: tuple[tuple[str, str], ...] = ()

    @property
    def model(self) -> str:
        return self.request.model or "-"

    @property
    def answered(self) -> int:
        """The status line the client got (the ``status`` label of ``gateway_requests_total``): a stream's 200
        even when it broke, which :attr:`result` tells."""
        sent = self.outcome.sent if self.outcome is not None else None
        return sent if sent is not None else self.status

    @property
    def result(self) -> str:
        """How the answer went, the ``outcome`` label beside that status (docs/observability.md)."""
        return result_of(self.answered, self.outcome.ending if self.outcome is not None else None)

    @property
    def decision(self) -> Decision | None:
        return self.last.decision if self.last is not None else None

    @property
    def first_byte_s(self) -> float | None:
        at = self.outcome.first_byte_at if self.outcome is not None else None
        return at - self.request.started if at is not None else None


# Endings whose name is the outcome (the others say only whether the status is an error).
_TOLD_ENDINGS = frozenset({Ending.ENGINE_ERROR, Ending.MALFORMED, Ending.UPSTREAM_BROKE, Ending.CLIENT_GONE,
                           Ending.CLIENT_STALLED})


def result_of(status: int, ending: Ending | None = None) -> str:
    """The ``outcome`` label of an answer: ``ok``, ``error`` (a 4xx or 5xx answer), or how a stream whose
    headers went out ended otherwise (``engine_error``, ``malformed``, ``upstream_broke``, ``client_gone``,
    ``client_stalled``)."""
    if ending is not None and ending in _TOLD_ENDINGS:
        return ending.value
    return "ok" if status < 400 else "error"
