"""Pods added and removed at runtime: a discovery source yields the whole pod set whenever it changes,
and the :class:`PodSetApplier` brings the gateway in line (registry, health, KV subscribers, metrics).

Owner: the applier is the only writer of the registry's membership after start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.background import cancel_and_wait
from gateway.config import PodConfig
from gateway.pods.registry import Pod, PodRegistry

log = logging.getLogger("gateway.discovery")


class DiscoverySource(Protocol):
    name: str

    def watch(self) -> AsyncIterator[list[PodConfig]]:
        """Yield the full set of pods now, then again each time it changes."""
        ...


@dataclass(slots=True)
class DiscoveryContext:
    """What a discovery plugin may use when it is built."""

    static_pods: list[PodConfig]


class PodSetApplier:
    def __init__(self, registry: PodRegistry, source: DiscoverySource, on_added: Callable[[Pod], Awaitable[None]],
                 on_removed: Callable[[str], Awaitable[None]]) -> None:
        self._source = source
        self._registry = registry
        self._on_added = on_added
        self._on_removed = on_removed
        self._task: asyncio.Task[None] | None = None
        self.applied = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(self._source), name=f"discovery-{self._source.name}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _follow(self, source: DiscoverySource) -> None:
        async for pods in source.watch():
            try:
                await self.apply(pods)
            except Exception:  # one bad update must not end discovery
                log.exception("applying a pod set from %s failed", source.name)

    async def apply(self, pods: list[PodConfig]) -> None:
        wanted = {p.name: p for p in pods}
        current = {p.name: p for p in self._registry.all()}
        for name, pod in current.items():
            if name not in wanted or wanted[name] != pod.config:
                self._registry.remove(name)
                await self._on_removed(name)
                log.info("pod %s removed", name)
        for name, cfg in wanted.items():
            if self._registry.get(name) is None:
                await self._on_added(self._registry.add(cfg))
                log.info("pod %s added (%s)", name, cfg.url)
        self.applied += 1
