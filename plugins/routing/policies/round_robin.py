"""``round_robin``: each candidate in turn, skipping pods that are unhealthy or excluded."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec, ProfileConfig
from plugins.routing.policies.shipped import part, shipped


def build(context: None, options: NoOptions) -> ProfileConfig:
    return shipped(picker=part("round_robin"))


PLUGIN = PluginSpec(NoOptions, build)
