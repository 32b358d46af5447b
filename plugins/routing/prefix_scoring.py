"""Parts shared by the cache-aware policies: the prefix matcher, the prefix and load scorers, the
overload guard and the picker.

The ``kv_aware``, ``prefix_cache`` and ``slo`` profiles compose these (entry points in
:mod:`plugins.routing.filters`, :mod:`plugins.routing.scorers`, :mod:`plugins.routing.pickers`).
"""

from __future__ import annotations

import time

import msgspec

from gateway.backends.registry import Pod
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.index import PrefixIndex
from gateway.load.ledger import InFlightLedger
from gateway.metrics import GatewayMetrics
from gateway.routing.pickers import MaxScorePicker
from gateway.routing.policy import NO_NEEDS, Needs, Pick, PolicyContext, PrefixMatch, RoutingRequest
from gateway.tokenization.conversation import request_text

# The defaults of the options every cache-aware policy shares, written once here.
# An offloaded block (CPU tier) counts this much of a GPU one.
OFFLOAD_WEIGHT = 0.5
# Approximate matches (untokenizable requests, a pod whose event stream broke) count this much.
APPROXIMATE_WEIGHT = 0.7
# A workflow or session thinking on a pod counts this much of a request in flight there.
IDLE_WEIGHT = 0.5


class CacheAwareOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The options of ``prefix_cache``, and the base of ``kv_aware``'s."""

    prefix_weight: float = 1.0
    load_weight: float = 0.3
    # The overload guard: past ``least + max(slack, ratio * least)`` requests in flight, a pod is skipped.
    overload_slack: int = 8
    overload_ratio: float = 0.5


class PrefixMatcher:
    """Finds how much of the prompt each candidate holds: precise (KV events) when the prompt has token
    ids and the policy has the index, else approximate (the gateway's own routing history of the text).
    Owner of the request's ``prefix`` and ``prefix_tokens``. What the chosen pod will hold once routed is
    recorded by the pipeline (:class:`gateway.request.context_steps.RoutedPrefix`)."""

    name = "prefix_match"

    def __init__(self, index: PrefixIndex | None, approximate: ApproximatePrefixIndex,
                 metrics: GatewayMetrics | None = None) -> None:
        self._index = index
        self._approximate = approximate
        self._metrics = metrics

    def prepare(self, request: RoutingRequest, pods: list[Pod]) -> None:
        if request.token_ids and self._index is not None:
            self._precise(request, self._index, pods)
        else:
            self._by_text(request, pods)

    def _precise(self, request: RoutingRequest, index: PrefixIndex, pods: list[Pod]) -> None:
        started = time.perf_counter()
        model = request.base_model or request.model
        hashes = request.hashes or index.prompt_hashes(model, request.lora_name, request.token_ids or [])
        matches = index.lookup(model, request.lora_name, hashes, [p.name for p in pods])
        if self._metrics:
            self._metrics.lookup_seconds.observe(time.perf_counter() - started)
        request.prefix = PrefixMatch(precise=True, hashes=hashes, pods=matches)
        for pod in pods:
            request.prefix_tokens[pod.name] = matches[pod.name].gpu_tokens

    def _by_text(self, request: RoutingRequest, pods: list[Pod]) -> None:
        text = request.prefix.text if request.prefix is not None else _text_of(request)
        if not text:  # nothing to match on: no prefix match at all (not an approximate one)
            request.prefix = None
            return
        request.prefix = PrefixMatch(precise=False, text=text,
                                     chars=self._approximate.lookup(text, [p.name for p in pods]))


def _text_of(request: RoutingRequest) -> str:
    return request_text(request.kind, request.body) if request.body is not None else ""


class PrefixScorer:
    """Share of the prompt cached on each pod, from the request's prefix match."""

    name = "prefix"
    needs: Needs = NO_NEEDS  # its matcher, given where it is built (plugins.routing.scorers)

    def __init__(self, *, offload_weight: float = OFFLOAD_WEIGHT, approximate_weight: float = APPROXIMATE_WEIGHT
                 ) -> None:
        self._offload_weight = offload_weight
        self._approximate_weight = approximate_weight

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        match = request.prefix
        if match is None:
            return [0.0] * len(pods)
        if match.precise:
            n = len(request.token_ids or ())
            out = []
            for pod in pods:
                m = match.pods[pod.name]
                tokens = m.gpu_tokens + self._offload_weight * m.offload_tokens
                out.append(tokens / n * (self._approximate_weight if m.approximate else 1.0))
            return out
        return [match.chars[p.name] / len(match.text) * self._approximate_weight for p in pods]


def prefix_parts(context: PolicyContext, *, precise: bool = True, offload_weight: float = OFFLOAD_WEIGHT,
                 approximate_weight: float = APPROXIMATE_WEIGHT) -> tuple[PrefixMatcher, PrefixScorer]:
    """The matcher and scorer every cache-aware policy builds the same way, on the gateway's indexes."""
    matcher = PrefixMatcher(context.index if precise else None, context.approximate, context.metrics)
    return matcher, PrefixScorer(offload_weight=offload_weight, approximate_weight=approximate_weight)


class LoadScorer:
    """1 for an idle pod, falling to 0 for the busiest candidate (requests in flight via this gateway)."""

    name = "load"

    def __init__(self, ledger: InFlightLedger) -> None:
        self._ledger = ledger

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        busy = [self._ledger.on_pod(p.name) for p in pods]
        busiest = max(busy)
        if busiest == 0:
            return [1.0] * len(pods)
        return [1.0 - b / busiest for b in busy]


class KvUsageScorer:
    """1 for the pod whose cache holds the fewest blocks (by the prefix index), towards 0 for the fullest:
    a prefix no pod has yet goes where it evicts least, so hot prefixes spread over the fleet's memory.
    A pod within ``as_full`` (a share of the fullest pod's blocks) of the fullest counts as full: once every
    cache is full, a few blocks more or less are churn, not room, and such a difference would decide every
    tie between idle pods, piling new prompts onto whichever pod evicted last (on the Mooncake replay, 38%
    of the requests on one of four pods, at a lower hit ratio)."""

    name = "kv_usage"

    def __init__(self, index: PrefixIndex, as_full: float = 0.02) -> None:
        self._index = index
        self._as_full = as_full

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        held = [self._index.blocks_on(p.name) for p in pods]
        most = max(held)
        if not most:
            return [1.0] * len(pods)
        return [free if (free := 1.0 - h / most) > self._as_full else 0.0 for h in held]


class OverloadGuard:
    """Drop pods far busier than the least busy one, so a hot prefix cannot pile onto one pod: past
    ``min + max(slack, ratio * min)`` in flight, the cache hit is traded for balance."""

    name = "overload_guard"

    def __init__(self, ledger: InFlightLedger, slack: int = 8, ratio: float = 0.5) -> None:
        self._ledger = ledger
        self._slack = slack
        self._ratio = ratio

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        busy = {p.name: self._ledger.on_pod(p.name) for p in pods}
        least = min(busy.values())
        limit = least + max(self._slack, self._ratio * least)
        return [p for p in pods if busy[p.name] <= limit]


class CacheAwarePicker:
    """Best total score; the reason says whether a cache hit, the load, or an overload decided."""

    name = "cache_aware"

    def __init__(self) -> None:
        self._best = MaxScorePicker("best_score")

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick:
        pick = self._best.pick(request, pods, scores)
        precise = request.precise
        if request.filtered_out:
            pick.reason = "rebalanced"
        elif precise is False:
            pick.reason = "approximate"
        elif self._spread_for_capacity(request, pods, pick.pod.name):
            pick.reason = "capacity_spread"
        elif precise and request.prefix_tokens.get(pick.pod.name, 0):
            pick.reason = "cache_hit"
        else:
            pick.reason = "no_hit_least_loaded"
        return pick

    @staticmethod
    def _spread_for_capacity(request: RoutingRequest, pods: list[Pod], chosen: str) -> bool:
        """Whether a pod with a longer cached prefix lost because placing there would evict more."""
        costs = request.placement
        # Among this attempt's candidates only: a retry's prefix_tokens still name the pod that failed.
        candidates = [p.name for p in pods if p.name in costs]
        if chosen not in candidates:
            return False
        hits = {pod: request.prefix_tokens.get(pod, 0) for pod in candidates}
        best_hit = max(hits, key=hits.__getitem__)
        return (best_hit != chosen and hits[best_hit] > hits[chosen]
                and costs[best_hit].overflow > costs[chosen].overflow)
