"""``slo``: KV-cache hits traded against Little's-law load, among pods with capacity for the request.

Score = ``prefix_weight`` * share of the prompt cached on the pod + ``load_weight`` * (1 - load after
taking it). With admission on, requests reach routing only when some pod can meet their SLO.
"""

from __future__ import annotations

import msgspec

from gateway.plugin_registry import PluginSpec
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.load_scoring import CapacityFilter, PendingLoadScorer
from plugins.routing.prefix_scoring import CacheAwarePicker, prefix_parts


class SloOptions(msgspec.Struct, forbid_unknown_fields=True):
    prefix_weight: float = 1.0
    load_weight: float = 0.5
    offload_weight: float = 0.5
    approximate_weight: float = 0.7


def build(context: PolicyContext, options: SloOptions) -> Policy:
    matcher, prefix = prefix_parts(context, offload_weight=options.offload_weight,
                                   approximate_weight=options.approximate_weight)
    return Policy(
        name="slo",
        picker=CacheAwarePicker(),
        filters=[CapacityFilter(context.load)],
        preparers=[matcher],
        scorers=[WeightedScorer(prefix, options.prefix_weight),
                 WeightedScorer(PendingLoadScorer(context.load), options.load_weight)],
        needs_tokens=True,
        needs_load=True,
    )


PLUGIN = PluginSpec(SloOptions, build)
