"""Parts shared by the cache-aware policies: prefix and load scorers, the overload guard, the picker.

Not a policy itself (no entry point): ``kv_aware`` and ``prefix_cache`` compose these.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gateway.backends.registry import Pod
from gateway.kv.approx import ApproximatePrefixIndex, request_text
from gateway.kv.index import PrefixIndex
from gateway.metrics import GatewayMetrics
from gateway.routing.pickers import MaxScorePicker
from gateway.routing.policy import Decision, Pick, RoutingRequest


class PrefixScorer:
    """Share of the prompt cached on each pod: precise (KV events) when the prompt has token ids and the
    index knows the pod, else approximate (the gateway's own routing history of the text)."""

    name = "prefix"

    def __init__(self, index: PrefixIndex | None, approximate: ApproximatePrefixIndex, *,
                 offload_weight: float = 0.5, approximate_weight: float = 0.7,
                 metrics: GatewayMetrics | None = None) -> None:
        self._index = index
        self._approximate = approximate
        self._offload_weight = offload_weight
        self._approximate_weight = approximate_weight
        self._metrics = metrics

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        if request.token_ids and self._index is not None:
            return self._precise(request, pods)
        return self._by_text(request, pods)

    def _precise(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        assert self._index is not None and request.token_ids is not None
        started = time.perf_counter()
        hashes = request.notes.get("hashes")
        if hashes is None:
            hashes = request.notes["hashes"] = self._index.prompt_hashes(
                request.base_model or request.model, request.lora_name, request.token_ids)
        matches = self._index.lookup(request.base_model or request.model, request.lora_name, hashes,
                                     [p.name for p in pods])
        if self._metrics:
            self._metrics.lookup_seconds.observe(time.perf_counter() - started)
        n = len(request.token_ids)
        scores = []
        for pod in pods:
            m = matches[pod.name]
            request.prefix_tokens[pod.name] = m.gpu_tokens
            tokens = m.gpu_tokens + self._offload_weight * m.offload_tokens
            scores.append(tokens / n * (self._approximate_weight if m.approximate else 1.0))
        request.notes["precise"] = True
        return scores

    def _by_text(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        text = request.notes.setdefault("text", _text_of(request))
        if not text:
            return [0.0] * len(pods)
        matched = self._approximate.lookup(text, [p.name for p in pods])
        request.notes["precise"] = False
        return [matched[p.name] / len(text) * self._approximate_weight for p in pods]

    def remember(self, request: RoutingRequest, decision: Decision) -> None:
        """After routing: the chosen pod will hold this prompt's blocks (speculative for the precise
        index until its events confirm them)."""
        if request.notes.get("precise") and self._index is not None and request.token_ids:
            self._index.expect(decision.pod.name, request.base_model or request.model, request.lora_name,
                               request.notes.get("hashes") or request.token_ids)
        else:
            text = request.notes.get("text") or _text_of(request)
            if text:
                self._approximate.record(text, decision.pod.name)


def _text_of(request: RoutingRequest) -> str:
    body = request.body
    return request_text(getattr(body, "messages", None), getattr(body, "prompt", None))


class LoadScorer:
    """1 for an idle pod, falling to 0 for the busiest candidate (requests in flight via this gateway)."""

    name = "load"

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        busiest = max(p.in_flight for p in pods)
        if busiest == 0:
            return [1.0] * len(pods)
        return [1.0 - p.in_flight / busiest for p in pods]


class KvUsageScorer:
    """1 for the pod whose cache holds the fewest blocks (by the prefix index), towards 0 for the fullest:
    a prefix no pod has yet goes where it evicts least, so hot prefixes spread over the fleet's memory."""

    name = "kv_usage"

    def __init__(self, index: PrefixIndex | None) -> None:
        self._index = index

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        if self._index is None:
            return [0.0] * len(pods)
        held = [self._index.blocks_on(p.name) for p in pods]
        most = max(held)
        return [1.0 - h / most if most else 1.0 for h in held]


class OverloadGuard:
    """Drop pods far busier than the least busy one, so a hot prefix cannot pile onto one pod: past
    ``min + max(slack, ratio * min)`` in flight, the cache hit is traded for balance."""

    name = "overload_guard"

    def __init__(self, slack: int = 8, ratio: float = 0.5) -> None:
        self._slack = slack
        self._ratio = ratio

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        least = min(p.in_flight for p in pods)
        limit = least + max(self._slack, self._ratio * least)
        kept = [p for p in pods if p.in_flight <= limit]
        if len(kept) < len(pods):
            request.notes["overloaded"] = [p.name for p in pods if p.in_flight > limit]
        return kept


class CacheAwarePicker:
    """Best total score; the reason says whether a cache hit, the load, or an overload decided."""

    name = "cache_aware"

    def __init__(self) -> None:
        self._best = MaxScorePicker("best_score")

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick:
        pick = self._best.pick(request, pods, scores)
        precise = request.notes.get("precise")
        hit = request.prefix_tokens.get(pick.pod.name, 0) if precise else None
        if request.notes.get("overloaded") or request.notes.get("over_capacity"):
            pick.reason = "rebalanced"
        elif precise is False:
            pick.reason = "approximate"
        elif self._spread_for_capacity(request, pick.pod.name):
            pick.reason = "capacity_spread"
        elif hit:
            pick.reason = "cache_hit"
        else:
            pick.reason = "no_hit_least_loaded"
        return pick

    @staticmethod
    def _spread_for_capacity(request: RoutingRequest, chosen: str) -> bool:
        """Whether a pod with a longer cached prefix lost because placing there would evict more."""
        costs = request.notes.get("placement")
        if not costs or chosen not in costs:
            return False
        # Among this attempt's candidates only: a retry's prefix_tokens still name the pod that failed.
        hits = {pod: request.prefix_tokens.get(pod, 0) for pod in costs}
        best_hit = max(hits, key=hits.__getitem__)
        return (best_hit != chosen and hits[best_hit] > hits[chosen]
                and costs[best_hit].overflow > costs[chosen].overflow)


def options_float(options: Mapping[str, Any], key: str, default: float) -> float:
    value = options.get(key, default)
    if not isinstance(value, int | float):
        raise ValueError(f"routing option {key!r} must be a number, got {value!r}")
    return float(value)
