"""``pending_load``: the pod with the least Little's-law load after taking the request, among those
with capacity for it (profiles from Redis; a default capacity per pod without one)."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec, ProfileConfig
from plugins.routing.policies.shipped import part, scorer, shipped


def build(context: None, options: NoOptions) -> ProfileConfig:
    return shipped(part("capacity"), scorers=(scorer("pending_load"),),
                   picker=part("max_score", reason="least_pending_load"))


PLUGIN = PluginSpec(NoOptions, build)
