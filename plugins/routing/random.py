"""``random``: a uniformly random candidate."""

from __future__ import annotations

from gateway.config import ProfileConfig
from gateway.plugin_registry import PluginSpec
from plugins.routing.filters import part, shipped
from plugins.routing.pickers import RandomOptions


def build(context: None, options: RandomOptions) -> ProfileConfig:
    return shipped(picker=part("random", seed=options.seed))


PLUGIN = PluginSpec(RandomOptions, build)
