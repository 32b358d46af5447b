"""``random``: a uniformly random candidate."""

from __future__ import annotations

import random

import msgspec

from gateway.plugin_api import Pick, PluginSpec, Pod, RoutingRequest


class RandomPicker:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick:
        return Pick(self._rng.choice(pods), "random", f"1 of {len(pods)}")


class RandomOptions(msgspec.Struct, forbid_unknown_fields=True):
    seed: int | None = None  # for reproducible runs


PLUGIN = PluginSpec(RandomOptions, lambda context, o: RandomPicker(random.Random(o.seed)))
