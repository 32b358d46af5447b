"""``cache_aware``: the best total score, with a reason saying whether a cache hit, the load, or an overload
decided."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, Pick, PluginSpec, Pod, RoutingRequest
from plugins.routing.pickers.max_score import MaxScorePicker


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


PLUGIN = PluginSpec(NoOptions, lambda context, options: CacheAwarePicker())
