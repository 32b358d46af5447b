"""``prefix_cache``: approximate prefix-cache routing for pods that publish no KV events.

The gateway remembers which pod it sent each text prefix to and sends the next request with that prefix
there, with the same load scoring and overload guard as ``kv_aware``. No tokenization needed.
"""

from __future__ import annotations

import msgspec

from gateway.plugin_api import PluginSpec, ProfileConfig
from plugins.routing.filters import overload_guard
from plugins.routing.policies.shipped import part, scorer, shipped


class CacheAwareOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The options of ``prefix_cache``, and the base of ``kv_aware``'s."""

    prefix_weight: float = 1.0
    load_weight: float = 0.3
    # The overload guard: past ``least + max(slack, ratio * least)`` requests in flight, a pod is skipped.
    overload_slack: int = overload_guard.SLACK
    overload_ratio: float = overload_guard.RATIO


def build(context: None, options: CacheAwareOptions) -> ProfileConfig:
    return shipped(
        part("overload_guard", slack=options.overload_slack, ratio=options.overload_ratio),
        scorers=(scorer("prefix", options.prefix_weight, precise=False, approximate_weight=1.0),
                 scorer("load", options.load_weight)),
        picker=part("cache_aware"),
    )


PLUGIN = PluginSpec(CacheAwareOptions, build)
