"""``prefix_cache``: approximate prefix-cache routing for pods that publish no KV events.

The gateway remembers which pod it sent each text prefix to and sends the next request with that prefix
there, with the same load scoring and overload guard as ``kv_aware``. No tokenization needed.
"""

from __future__ import annotations

from gateway.kv.approx import ApproximatePrefixIndex
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.prefix_scoring import CacheAwarePicker, LoadScorer, OverloadGuard, PrefixScorer, options_float


def build(context: PolicyContext) -> Policy:
    o = context.options
    prefix = PrefixScorer(None, context.approximate or ApproximatePrefixIndex(), approximate_weight=1.0)
    return Policy(
        name="prefix_cache",
        picker=CacheAwarePicker(),
        filters=[OverloadGuard(int(options_float(o, "overload_slack", 8)), options_float(o, "overload_ratio", 0.5))],
        scorers=[WeightedScorer(prefix, options_float(o, "prefix_weight", 1.0)),
                 WeightedScorer(LoadScorer(), options_float(o, "load_weight", 0.3))],
        on_routed=[prefix.remember],
    )
