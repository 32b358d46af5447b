"""``prefix_cache``: approximate prefix-cache routing for pods that publish no KV events.

The gateway remembers which pod it sent each text prefix to and sends the next request with that prefix
there, with the same load scoring and overload guard as ``kv_aware``. No tokenization needed.
"""

from __future__ import annotations

from gateway.plugin_registry import PluginSpec
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.prefix_scoring import CacheAwareOptions, CacheAwarePicker, LoadScorer, OverloadGuard, prefix_parts


def build(context: PolicyContext, options: CacheAwareOptions) -> Policy:
    matcher, prefix = prefix_parts(context, precise=False, approximate_weight=1.0)
    return Policy(
        name="prefix_cache",
        picker=CacheAwarePicker(),
        filters=[OverloadGuard(context.ledger, options.overload_slack, options.overload_ratio)],
        preparers=[matcher],
        scorers=[WeightedScorer(prefix, options.prefix_weight),
                 WeightedScorer(LoadScorer(context.ledger), options.load_weight)],
    )


PLUGIN = PluginSpec(CacheAwareOptions, build)
