"""``slo``: KV-cache hits traded against Little's-law load, among pods with capacity for the request.

Score = ``prefix_weight`` * share of the prompt cached on the pod + ``load_weight`` * (1 - load after
taking it). With admission on, requests reach routing only when some pod can meet their SLO.
"""

from __future__ import annotations

import msgspec

from gateway.plugin_api import PluginSpec, ProfileConfig
from plugins.routing.policies.shipped import part, scorer, shipped
from plugins.routing.scorers.prefix import APPROXIMATE_WEIGHT, OFFLOAD_WEIGHT


class SloOptions(msgspec.Struct, forbid_unknown_fields=True):
    prefix_weight: float = 1.0
    load_weight: float = 0.5
    offload_weight: float = OFFLOAD_WEIGHT
    approximate_weight: float = APPROXIMATE_WEIGHT


def build(context: None, options: SloOptions) -> ProfileConfig:
    return shipped(
        part("capacity"),
        scorers=(scorer("prefix", options.prefix_weight, offload_weight=options.offload_weight,
                        approximate_weight=options.approximate_weight),
                 scorer("pending_load", options.load_weight)),
        picker=part("cache_aware"),
    )


PLUGIN = PluginSpec(SloOptions, build)
