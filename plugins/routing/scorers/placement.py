"""``placement``: ``kv_aware``'s cost in tokens of placing the request on each pod (the prompt not cached, the
resumable contexts evicted, the adapter switched in), as a score (the cost model:
:mod:`plugins.routing.preparers.placement`)."""

from __future__ import annotations

import msgspec

from gateway.plugin_api import NO_NEEDS, Needs, PluginSpec, Pod, PolicyContext, RoutingRequest
from plugins.routing.preparers.placement import PlacementPlanner
from plugins.routing.scorers.prefix import APPROXIMATE_WEIGHT, OFFLOAD_WEIGHT, PrefixScorer, prefix_parts


class PlacementScorer:
    """``1 - cost / (P + max overflow)`` over the candidates; the plain prefix share when the planner had
    nothing to cost (no precise match)."""

    name = "placement"
    needs: Needs = NO_NEEDS  # its matcher and planner, given where it is built (``build`` here)

    def __init__(self, prefix: PrefixScorer) -> None:
        self._prefix = prefix

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        costs = request.placement
        if not costs or request.token_ids is None:
            return self._prefix.score(request, pods)
        worst = len(request.token_ids) + max(costs[p.name].overflow for p in pods) \
            + max(costs[p.name].switch for p in pods)
        return [max(0.0, 1.0 - costs[p.name].total / worst) for p in pods]


class PlacementOptions(msgspec.Struct, forbid_unknown_fields=True):
    offload_weight: float = OFFLOAD_WEIGHT
    approximate_weight: float = APPROXIMATE_WEIGHT


def build(context: PolicyContext, o: PlacementOptions) -> PlacementScorer:
    matcher, prefix = prefix_parts(context, offload_weight=o.offload_weight, approximate_weight=o.approximate_weight)
    planner = PlacementPlanner(context.working_set, context.capacity_of, clock=context.clock)
    scorer = PlacementScorer(prefix)
    scorer.needs = Needs(preparers=(matcher, planner), tokens=True, places_contexts=True)
    return scorer


PLUGIN = PluginSpec(PlacementOptions, build)
