"""``kv_aware``: precise prefix-cache routing from the pods' own KV events.

Score = ``prefix_weight`` * share of the prompt cached on the pod (from the prefix index) +
``load_weight`` * idleness + ``kv_usage_weight`` * free cache (fewest indexed blocks). Pods far busier
than the least busy are filtered out first, so a hot prefix spreads once its pod is overloaded.
Requests that cannot be tokenized are scored on the approximate text history instead (the decision's
reason says so).
"""

from __future__ import annotations

from gateway.kv.approx import ApproximatePrefixIndex
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.prefix_scoring import (
    CacheAwarePicker,
    KvUsageScorer,
    LoadScorer,
    OverloadGuard,
    PrefixScorer,
    options_float,
)


def build(context: PolicyContext) -> Policy:
    o = context.options
    prefix = PrefixScorer(
        context.index, context.approximate or ApproximatePrefixIndex(),
        offload_weight=options_float(o, "offload_weight", 0.5),
        approximate_weight=options_float(o, "approximate_weight", 0.7),
        metrics=context.metrics,
    )
    return Policy(
        name="kv_aware",
        picker=CacheAwarePicker(),
        filters=[OverloadGuard(int(options_float(o, "overload_slack", 8)), options_float(o, "overload_ratio", 0.5))],
        scorers=[WeightedScorer(prefix, options_float(o, "prefix_weight", 1.0)),
                 WeightedScorer(LoadScorer(), options_float(o, "load_weight", 0.3)),
                 WeightedScorer(KvUsageScorer(context.index), options_float(o, "kv_usage_weight", 0.1))],
        needs_tokens=True,
        on_routed=[prefix.remember],
    )
