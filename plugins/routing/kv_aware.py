"""``kv_aware``: precise prefix-cache routing from the pods' own KV events, placed by cost in tokens.

Score = ``prefix_weight`` * placement score (the prompt tokens the pod has cached, less the tokens of
resumable contexts it would have to evict: :mod:`plugins.routing.placement`) + ``load_weight`` *
idleness (requests in flight plus ``idle_weight`` per workflow or session thinking there) +
``kv_usage_weight`` * free cache (fewest indexed blocks). Pods far busier than the least busy are
filtered out first, so a hot prefix spreads once its pod is overloaded. Requests that cannot be tokenized
are scored on the approximate text history instead (the decision's reason says so).
"""

from __future__ import annotations

from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.placement import PlacementScorer, ResumableLoadScorer
from plugins.routing.prefix_scoring import (
    CacheAwarePicker,
    KvUsageScorer,
    OverloadGuard,
    PrefixScorer,
    options_float,
)


def build(context: PolicyContext) -> Policy:
    o = context.options
    if context.index is None:
        raise ValueError("kv_aware needs the gateway's prefix index")
    prefix = PrefixScorer(
        context.index, context.approximate or ApproximatePrefixIndex(),
        offload_weight=options_float(o, "offload_weight", 0.5),
        approximate_weight=options_float(o, "approximate_weight", 0.7),
        metrics=context.metrics,
    )
    working_set = context.working_set if context.working_set is not None else ResumableWorkingSet()
    placement = PlacementScorer(prefix, context.index, working_set, context.capacity_of or (lambda pod: None),
                                clock=context.clock)
    return Policy(
        name="kv_aware",
        picker=CacheAwarePicker(),
        filters=[OverloadGuard(int(options_float(o, "overload_slack", 8)), options_float(o, "overload_ratio", 0.5))],
        scorers=[WeightedScorer(placement, options_float(o, "prefix_weight", 1.0)),
                 WeightedScorer(ResumableLoadScorer(working_set, options_float(o, "idle_weight", 0.5)),
                                options_float(o, "load_weight", 0.3)),
                 WeightedScorer(KvUsageScorer(context.index), options_float(o, "kv_usage_weight", 0.1))],
        needs_tokens=True,
        on_routed=[prefix.remember, placement.hold],
        on_finished=[placement.idle],
    )
