"""``round_robin``: each candidate in turn."""

from __future__ import annotations

import itertools

from gateway.plugin_api import NoOptions, Pick, PluginSpec, Pod, RoutingRequest


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick:
        turn = next(self._counter)
        return Pick(pods[turn % len(pods)], "rotation", f"turn {turn} over {len(pods)}")


PLUGIN = PluginSpec(NoOptions, lambda context, options: RoundRobinPicker())
