"""``random``: a uniformly random candidate."""

from __future__ import annotations

import random

import msgspec

from gateway.plugin_registry import PluginSpec
from gateway.routing.pickers import RandomPicker
from gateway.routing.policy import Policy, PolicyContext


class RandomOptions(msgspec.Struct, forbid_unknown_fields=True):
    seed: int | None = None  # for reproducible runs


def build(context: PolicyContext, options: RandomOptions) -> Policy:
    return Policy(name="random", picker=RandomPicker(random.Random(options.seed)))


PLUGIN = PluginSpec(RandomOptions, build)
