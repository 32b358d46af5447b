"""``static`` (default): the pods of the config, once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.plugin_api import DiscoveryContext, NoOptions, PluginSpec, PodConfig


class StaticSource:
    name = "static"

    def __init__(self, pods: list[PodConfig]) -> None:
        self._pods = pods

    async def watch(self) -> AsyncIterator[list[PodConfig]]:
        yield list(self._pods)
        await asyncio.Event().wait()  # never changes


def build(context: DiscoveryContext, options: NoOptions) -> StaticSource:
    return StaticSource(context.static_pods)


PLUGIN = PluginSpec(NoOptions, build)
