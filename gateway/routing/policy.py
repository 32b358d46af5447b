"""The plugin interfaces of routing and the :class:`Policy` that composes them.

A policy narrows the candidates with filters, scores the survivors with weighted scorers (each score
in ``[0, 1]``, higher is better) and lets a picker choose one. Plugins build policies from these parts;
the :class:`~gateway.routing.router.Router` only runs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.backends.registry import Pod, PodRegistry

if TYPE_CHECKING:
    from gateway.kv.approx import ApproximatePrefixIndex
    from gateway.kv.index import PrefixIndex
    from gateway.kv.working_set import Context, ResumableWorkingSet
    from gateway.load.pending import Estimate, PendingLoad
    from gateway.metrics import GatewayMetrics


@dataclass(slots=True)
class RoutingRequest:
    request_id: str
    model: str
    # The API path family: "chat", "completions", "responses", "embeddings".
    kind: str
    body: Any = None
    token_ids: list[int] | None = None
    # The base model and LoRA adapter the prompt's KV blocks are namespaced by.
    base_model: str = ""
    lora_name: str | None = None
    input_tokens: int = 0
    predicted_output_tokens: int = 0
    # Per pod, the request's predicted cost there (filled when admission or the policy needs load).
    estimates: dict[str, Estimate] = field(default_factory=dict)
    # Filled by scorers: predicted cached prompt tokens per pod, and notes for the decision's reason.
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    # The workflow or session the request belongs to (None: anonymous), and its resumable context once
    # a placement-aware policy has routed it.
    context_key: str | None = None
    context: Context | None = None


@dataclass(slots=True)
class Decision:
    pod: Pod
    policy: str
    # A short, countable reason code ("rotation", "least_in_flight", ...) and a human detail.
    reason: str
    detail: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    prefix_tokens: int = 0
    attempt: int = 0


class Filter(Protocol):
    name: str

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]: ...


class Scorer(Protocol):
    name: str

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]: ...


@dataclass(slots=True)
class Pick:
    pod: Pod
    reason: str
    detail: str = ""


class Picker(Protocol):
    name: str

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick: ...


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float = 1.0


RoutedHook = Callable[[RoutingRequest, Decision], None]
# Called when an attempt on the decided pod ends, however it ended.
FinishedHook = Callable[[RoutingRequest, Decision], None]


@dataclass(slots=True)
class Policy:
    name: str
    picker: Picker
    filters: list[Filter] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    # Whether the proxy must tokenize the prompt, or estimate its load per pod, before routing.
    needs_tokens: bool = False
    needs_load: bool = False
    # Called with the decision once a pod is chosen (e.g. to record what that pod will now cache).
    on_routed: list[RoutedHook] = field(default_factory=list)
    on_finished: list[FinishedHook] = field(default_factory=list)


@dataclass(slots=True)
class PolicyContext:
    """What a policy plugin may use when it is built."""

    pods: PodRegistry
    options: Mapping[str, Any] = field(default_factory=dict)
    index: PrefixIndex | None = None
    approximate: ApproximatePrefixIndex | None = None
    metrics: GatewayMetrics | None = None
    load: PendingLoad | None = None
    working_set: ResumableWorkingSet | None = None
    # A pod's KV capacity in tokens, when known.
    capacity_of: Callable[[str], float | None] | None = None
    clock: Callable[[], float] = time.monotonic


class PolicyFactory(Protocol):
    def __call__(self, context: PolicyContext) -> Policy: ...
