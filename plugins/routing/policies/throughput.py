"""``throughput``: the pod that can still take the most requests/s of this request's shape, by its
deployment's profile and its current load."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec, ProfileConfig
from plugins.routing.policies.shipped import part, scorer, shipped


def build(context: None, options: NoOptions) -> ProfileConfig:
    return shipped(part("capacity"), scorers=(scorer("throughput"),), picker=part("max_score", reason="most_headroom"))


PLUGIN = PluginSpec(NoOptions, build)
