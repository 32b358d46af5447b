"""``round_robin``: each candidate in turn, skipping pods that are unhealthy or excluded."""

from __future__ import annotations

import itertools

from gateway.backends.registry import Pod
from gateway.config import ProfileConfig
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.routing.policy import Pick, RoutingRequest
from plugins.routing.filters import part, shipped


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick:
        turn = next(self._counter)
        return Pick(pods[turn % len(pods)], "rotation", f"turn {turn} over {len(pods)}")


def build(context: None, options: NoOptions) -> ProfileConfig:
    return shipped(picker=part("round_robin"))


PLUGIN = PluginSpec(NoOptions, build)
