"""``random``: a uniformly random candidate."""

from __future__ import annotations

from gateway.plugin_api import PluginSpec, ProfileConfig
from plugins.routing.pickers.random import RandomOptions
from plugins.routing.policies.shipped import part, shipped


def build(context: None, options: RandomOptions) -> ProfileConfig:
    return shipped(picker=part("random", seed=options.seed))


PLUGIN = PluginSpec(RandomOptions, build)
