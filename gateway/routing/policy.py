"""The plugin interfaces of routing and the :class:`Policy` that composes them.

A policy narrows the candidates with filters, lets its preparers compute what its scorers share (the
prefix match, the placement costs), scores the survivors with weighted scorers (each score in ``[0, 1]``,
higher is better; a scorer only scores), lets a settler (the workflow or session pin) settle the choice
and otherwise a picker choose one. Policies are built from declared profiles
(:mod:`gateway.routing.profiles`); the :class:`~gateway.routing.router.Router` only runs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.core.inference_api import RequestKind
from gateway.pods.registry import Leg, Pod, PodRegistry

if TYPE_CHECKING:
    from gateway.kv.approx import ApproximatePrefixIndex
    from gateway.kv.contexts import Context
    from gateway.kv.hashing import PromptHashes
    from gateway.kv.index import PrefixIndex
    from gateway.kv.views import PodMatch
    from gateway.kv.working_set import ResumableWorkingSet
    from gateway.load.ledger import InFlightLedger
    from gateway.load.pending import Estimate, PendingLoad
    from gateway.metrics import GatewayMetrics


@dataclass(slots=True)
class PrefixMatch:
    """How much of the prompt each candidate pod holds: the policy's prefix matcher writes it, scorers
    and pickers read it."""

    # True: from the pods' own KV events (token ids); False: from the approximate text history.
    precise: bool
    hashes: PromptHashes | None = None  # precise only: the prompt's block hashes, computed once
    text: str = ""  # approximate only: the prompt's canonical text
    pods: dict[str, PodMatch] = field(default_factory=dict)  # precise: per candidate
    chars: dict[str, int] = field(default_factory=dict)  # approximate: leading characters matched


@dataclass(slots=True)
class PlacementCost:
    """One pod's cost for one request, in tokens (:mod:`plugins.routing.preparers.placement`)."""

    uncached: int
    overflow: float
    switch: float = 0.0  # a LoRA request's adapter switched into the pod's batch slots, or loaded there

    @property
    def total(self) -> float:
        return self.uncached + self.overflow + self.switch


@dataclass(slots=True)
class RoutingRequest:
    """One request as routing sees it. The director fills the request's own facts; the fields after them
    are routing state, each written by the one part named beside it and read by the rest."""

    request_id: str
    model: str
    kind: RequestKind
    body: Any = None
    # The base model and LoRA adapter the prompt's KV blocks are namespaced by.
    base_model: str = ""
    lora_name: str | None = None
    # The leg being routed when prefill and decode are served by two pods (None: the whole request): only
    # pods taking that leg are candidates.
    leg: Leg | None = None
    # Prompt tokenization: the token ids exactly as the engine will see them, and (for a model whose
    # predictions drift) the local tokenizer's count, as a probe.
    token_ids: Sequence[int] | None = None
    probe_tokens: int | None = None
    # Prompt tokenization, too: the prompt's block hashes (computed lazily, shared by everyone who looks
    # the prompt up), and the block hashes of the conversation's earlier prompt they reuse (None: none).
    hashes: PromptHashes | None = None
    continued: PromptHashes | None = None
    # Prompt tokenization, too: a prompt may be routed on its head (a next turn on its earlier prompt), the rest
    # tokenized when its attempt ends (``complete_prompt``, called once by the first step to finish); until
    # then ``token_ids`` and ``hashes`` are the prompt's head and about this many tokens follow it (0: whole).
    untokenized_tokens: int = 0
    complete_prompt: Callable[[], None] | None = None
    # Context resolution: the context the request continues (a workflow, a session, or a conversation
    # recognised by its prompt; None: it cannot be told), and whether the client named it.
    context_key: str | None = None
    context_keyed: bool = False
    # Context resolution, too: how long the client declared it will reuse the prompt (gateway.core.retention).
    retention_s: float | None = None
    # Load estimation: the request's size, and per pod its predicted cost there.
    input_tokens: int = 0
    predicted_output_tokens: int = 0
    estimates: dict[str, Estimate] = field(default_factory=dict)
    # Flow control: the pods that had room when the request was released after waiting (None: it did not
    # wait); the router keeps to them unless none is left.
    room: frozenset[str] | None = None
    # The director: how long the request may wait in flow control for this target before the next target
    # of its model rule is tried (None: as long as its flow allows).
    max_wait_s: float | None = None
    # The gateway's adapter placement (gateway.models.adapters), per candidate pod: what placing this LoRA
    # request there costs besides its prompt, in tokens (its adapter switched into a batch slot, or loaded).
    switch_cost: dict[str, float] = field(default_factory=dict)
    # The router, per attempt: the pod the request's workflow or session is pinned to (its filters see
    # that the request continues a context there), why, and whether the pin binds (the ``pin`` filter
    # keeps the request there) or is only a hint; and filter name → the pods it removed.
    pin: str | None = None
    pin_reason: str = "pinned"
    pin_binding: bool = True
    filtered_out: dict[str, list[str]] = field(default_factory=dict)
    # The prefix matcher: what each pod holds, and the predicted cached prompt tokens per pod.
    prefix: PrefixMatch | None = None
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    # The placement planner: each pod's cost, and the request's live context in the working set.
    placement: dict[str, PlacementCost] = field(default_factory=dict)
    context: Context | None = None

    @property
    def precise(self) -> bool | None:
        """Whether the prefix match came from KV events (None: no prefix matcher ran)."""
        return None if self.prefix is None else self.prefix.precise


@dataclass(slots=True)
class Decision:
    pod: Pod
    policy: str
    # A short, countable reason code ("rotation", "least_in_flight", ...) and a human detail.
    reason: str
    detail: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    prefix_tokens: int = 0
    # The pod the request was pinned to (its workflow's or session's) when the pin could not be kept, and
    # why: the filter that dropped it ("overload_guard", ...), or "pod_unavailable" (unhealthy, ejected,
    # or failed on an earlier attempt).
    unpinned: str | None = None
    unpinned_by: str = ""


class Filter(Protocol):
    name: str

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]: ...


class Settler(Protocol):
    """A filter that keeps one pod and settles the choice (the workflow or session pin): it runs after the
    scorers, so that the decision's scores still rank every candidate (an edge's fallbacks come from them)."""

    name: str

    def settle(self, request: RoutingRequest, pods: list[Pod]) -> Pick | None: ...


class Preparer(Protocol):
    """Computes, once per attempt, the data the policy's scorers and picker share (after the filters)."""

    name: str

    def prepare(self, request: RoutingRequest, pods: list[Pod]) -> None: ...


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


@dataclass(frozen=True, slots=True)
class Needs:
    """What a part of a policy needs from the pipeline and from other parts (a part's optional ``needs``
    attribute): the preparers whose results it reads (shared by name: one runs per policy), whether the
    prompt must be tokenized or its load estimated per pod first, and whether it places continuing contexts
    with their cache itself (then a workflow's preserve is a hint, not a pin)."""

    preparers: tuple[Preparer, ...] = ()
    tokens: bool = False
    load: bool = False
    places_contexts: bool = False


NO_NEEDS = Needs()


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float = 1.0


@dataclass(slots=True)
class Policy:
    name: str
    picker: Picker
    filters: list[Filter] = field(default_factory=list)
    preparers: list[Preparer] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    # Whether the pipeline must tokenize the prompt, or estimate its load per pod, before routing.
    needs_tokens: bool = False
    needs_load: bool = False
    # Whether its own placement keeps a continuing context with its cache (weighing load as it does): a
    # workflow's preserve is then a hint its filters see, not a pin that overrides it.
    places_contexts: bool = False
    # Run after the scorers, in order: the first that settles the choice decides instead of the picker.
    settlers: list[Settler] = field(default_factory=list)


@dataclass(slots=True)
class PolicyContext:
    """What a policy plugin may use when it is built: the gateway's shared components (never private
    copies, so that every policy sees the same index, load and working set)."""

    pods: PodRegistry
    index: PrefixIndex
    approximate: ApproximatePrefixIndex
    metrics: GatewayMetrics
    load: PendingLoad
    ledger: InFlightLedger
    working_set: ResumableWorkingSet
    # A pod's KV capacity in tokens, when known.
    capacity_of: Callable[[str], float | None]
    clock: Callable[[], float] = time.monotonic
    # The gateway's LoRA adapter placement (gateway.models.adapters), which the ``adapter_resident`` filter
    # runs (none: no adapter is placed; the filter keeps every pod).
    adapter_placement: Filter | None = None

    @classmethod
    def standalone(cls, pods: PodRegistry, **parts: Any) -> PolicyContext:
        """A context of fresh components (any of them given in ``parts`` instead), for a router used on
        its own: tests, benchmarks, embedding the routing in another program."""
        from gateway.config import PlacementConfig
        from gateway.kv.approx import ApproximatePrefixIndex
        from gateway.kv.index import PrefixIndex
        from gateway.kv.working_set import ResumableWorkingSet
        from gateway.load.ledger import InFlightLedger
        from gateway.load.pending import PendingLoad
        from gateway.load.slo_profiles import ProfileStore
        from gateway.metrics import GatewayMetrics

        ledger = parts.pop("ledger", None) or InFlightLedger()
        defaults: dict[str, Any] = {
            "index": PrefixIndex(), "approximate": ApproximatePrefixIndex(), "metrics": GatewayMetrics(),
            "load": PendingLoad(ProfileStore(None), ledger, default_capacity=64, deployment_of=str),
            "working_set": ResumableWorkingSet(PlacementConfig(), ledger), "capacity_of": lambda pod: None,
        }
        return cls(pods=pods, ledger=ledger, **{**defaults, **parts})

