"""The host's indexer: with ``gateway serve --workers N``, the process that applies the pods' KV events once
for the whole host, into a prefix index in shared memory that every worker reads in place.

Each of ``kv_index.ingest_processes`` indexers takes a share of the pods (by a hash of the pod's name): it
subscribes to their events and replays, checks their health (a pod that fails its checks has its blocks
dropped, as a worker's own subscriber did), writes its own index files, and every half second copies its
subscribers' counters into them for the workers' ``/metrics``. A worker reads each indexer's files
(:class:`~gateway.kv.index.PrefixIndex` with readers): nothing is copied to it, nothing on its request path
waits for the indexer, and what it reads is as old as the last batch the indexer applied.

Why one writer rather than a subscriber per worker: each worker used to decode and apply every event, so N
workers cost N times the ingest, and a fleet's events (about 1.2 million block events a second for 1,000
busy GPU pods) would take a core per worker. Why shared memory rather than forwarding decoded events to the
workers: forwarding costs a serialisation and an apply per event per worker, which is the cost being removed.

Owner: the supervisor starts, restarts and stops the indexers; an indexer owns its subscribers and its
index files (the supervisor removes the directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal

from gateway.background import cancel_and_wait, raise_open_files_limit
from gateway.cluster.identity import WorkerIdentity
from gateway.config import GatewayConfig
from gateway.http_client import HttpClient
from gateway.kits.fleet import discovery_source
from gateway.kv._blockindex import BlockIndex
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriptions import KvEventService
from gateway.pods.discovery import PodSetApplier
from gateway.pods.health import HealthChecker
from gateway.pods.registry import Pod, PodRegistry

log = logging.getLogger("gateway.indexer")

MIRROR_COUNTERS_S = 0.5


def shard_of(pod: str, shards: int) -> int:
    """Which indexer applies the pod's events (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(pod.encode(), digest_size=8).digest(), "little") % shards


class Indexer:
    def __init__(self, config: GatewayConfig, identity: WorkerIdentity, shard: int) -> None:
        ki = config.kv_index
        self.shard, self.shards = shard, ki.ingest_processes
        keeping_warm = config.workflow.enabled and config.workflow.keep_warm.enabled
        self.store = BlockIndex(path=identity.index_path(shard), max_views=ki.max_views,
                                max_blocks_per_view=ki.max_blocks_per_view,
                                ring=ki.eviction_notes if keeping_warm else 0)
        self.http = HttpClient()
        self.pods = PodRegistry(config.pods, config.health)
        self.kv = KvEventService(PrefixIndex(stores=[self.store], speculative_ttl_s=0))
        # Its checks are the host's too: its share is one process's among the workers and indexers.
        self.health = HealthChecker(self.pods, self.http, config.health, self.kv.pod_health_changed,
                                    share=1 / (identity.count + self.shards))
        self.discovery = (PodSetApplier(self.pods, discovery_source(config), self._added, self.kv.remove_pod)
                          if config.discovery.source != "static" else None)
        self._mirror: asyncio.Task[None] | None = None

    def mine(self, pod: Pod) -> bool:
        return shard_of(pod.name, self.shards) == self.shard

    async def _added(self, pod: Pod) -> None:
        await self.health.check(pod, initial=True, refresh_models=True)
        if self.mine(pod):
            self.kv.add_pod(pod)

    async def start(self) -> None:
        await self.http.start()
        await self.health.start()
        for pod in self.pods.all():
            if self.mine(pod):
                self.kv.add_pod(pod)
        if self.discovery is not None:
            await self.discovery.start()
        self._mirror = asyncio.create_task(self._mirror_counters(), name="kv-counters")

    async def _mirror_counters(self) -> None:
        while True:
            await asyncio.sleep(MIRROR_COUNTERS_S)
            self.kv.mirror_counters()

    async def stop(self) -> None:
        """In reverse, each even if another fails."""
        steps = [lambda: cancel_and_wait(self._mirror)]
        if self.discovery is not None:
            steps.append(self.discovery.stop)
        steps += [self.kv.stop, self.health.stop, self.http.stop]
        for step in steps:
            try:
                await step()
            except Exception:
                log.exception("stopping the indexer failed at one step; going on")


async def run_indexer(config: GatewayConfig, identity: WorkerIdentity, shard: int,
                      ready: asyncio.Event | None = None) -> None:
    """One indexer process, until SIGTERM or SIGINT."""
    raise_open_files_limit()  # a subscriber per pod
    indexer = Indexer(config, identity, shard)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await indexer.start()
        log.info("indexer %d of %d: %d pods' KV events", shard, indexer.shards,
                 sum(1 for pod in indexer.pods.all() if indexer.mine(pod)))
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        await indexer.stop()
