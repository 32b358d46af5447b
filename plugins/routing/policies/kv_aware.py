"""``kv_aware``: precise prefix-cache routing from the pods' own KV events, placed by cost in tokens.

Score = ``prefix_weight`` * placement score (the prompt tokens the pod has cached, less the tokens of
resumable contexts it would have to evict: :mod:`plugins.routing.preparers.placement`) + ``load_weight`` *
idleness (requests in flight plus ``idle_weight`` per workflow or session thinking there) +
``kv_usage_weight`` * free cache (fewest indexed blocks). Pods far busier than the least busy are
filtered out first, so a hot prefix spreads once its pod is overloaded. Requests that cannot be tokenized
are scored on the approximate text history instead (the decision's reason says so).
"""

from __future__ import annotations

from gateway.plugin_api import PluginSpec, ProfileConfig
from plugins.routing.filters import context_balance
from plugins.routing.policies.prefix_cache import CacheAwareOptions
from plugins.routing.policies.shipped import part, scorer, shipped
from plugins.routing.scorers.prefix import APPROXIMATE_WEIGHT, OFFLOAD_WEIGHT
from plugins.routing.scorers.resumable_load import IDLE_WEIGHT


class KvAwareOptions(CacheAwareOptions, forbid_unknown_fields=True):
    offload_weight: float = OFFLOAD_WEIGHT
    approximate_weight: float = APPROXIMATE_WEIGHT
    idle_weight: float = IDLE_WEIGHT
    kv_usage_weight: float = 0.1
    # Under pressure, a starting workflow or session goes to a pod with at most this many more contexts
    # than the least loaded; none: no such balance (the cost in tokens alone decides).
    balance_slack: int | None = context_balance.SLACK


def build(context: None, options: KvAwareOptions) -> ProfileConfig:
    balance = [part("context_balance", slack=options.balance_slack)] if options.balance_slack is not None else []
    return shipped(
        part("overload_guard", slack=options.overload_slack, ratio=options.overload_ratio), *balance,
        scorers=(scorer("placement", options.prefix_weight, offload_weight=options.offload_weight,
                        approximate_weight=options.approximate_weight),
                 scorer("resumable_load", options.load_weight, idle_weight=options.idle_weight),
                 scorer("kv_usage", options.kv_usage_weight)),
        picker=part("cache_aware"),
    )


PLUGIN = PluginSpec(KvAwareOptions, build)
