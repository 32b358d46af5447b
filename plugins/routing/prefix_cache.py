"""``prefix_cache``: approximate prefix-cache routing for pods that publish no KV events.

The gateway remembers which pod it sent each text prefix to and sends the next request with that prefix
there, with the same load scoring and overload guard as ``kv_aware``. No tokenization needed.
"""

from __future__ import annotations

from gateway.config import ProfileConfig
from gateway.plugin_registry import PluginSpec
from plugins.routing.filters import part, scorer, shipped
from plugins.routing.prefix_scoring import CacheAwareOptions


def build(context: None, options: CacheAwareOptions) -> ProfileConfig:
    return shipped(
        part("overload_guard", slack=options.overload_slack, ratio=options.overload_ratio),
        scorers=(scorer("prefix", options.prefix_weight, precise=False, approximate_weight=1.0),
                 scorer("load", options.load_weight)),
        picker=part("cache_aware"),
    )


PLUGIN = PluginSpec(CacheAwareOptions, build)
