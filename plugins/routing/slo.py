"""``slo``: KV-cache hits traded against Little's-law load, among pods with capacity for the request.

Score = ``prefix_weight`` * share of the prompt cached on the pod + ``load_weight`` * (1 - load after
taking it). With admission on, requests reach routing only when some pod can meet their SLO.
"""

from __future__ import annotations

from gateway.kv.approx import ApproximatePrefixIndex
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.load_scoring import CapacityFilter, PendingLoadScorer
from plugins.routing.prefix_scoring import CacheAwarePicker, PrefixScorer, options_float


def build(context: PolicyContext) -> Policy:
    assert context.load is not None, "slo needs the gateway's PendingLoad"
    o = context.options
    prefix = PrefixScorer(context.index, context.approximate or ApproximatePrefixIndex(),
                          offload_weight=options_float(o, "offload_weight", 0.5),
                          approximate_weight=options_float(o, "approximate_weight", 0.7), metrics=context.metrics)
    return Policy(
        name="slo",
        picker=CacheAwarePicker(),
        filters=[CapacityFilter(context.load)],
        scorers=[WeightedScorer(prefix, options_float(o, "prefix_weight", 1.0)),
                 WeightedScorer(PendingLoadScorer(context.load), options_float(o, "load_weight", 0.5))],
        needs_tokens=True,
        needs_load=True,
        on_routed=[prefix.remember],
    )
