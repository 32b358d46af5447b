"""Wires KV events to the prefix index: one subscriber per pod and DP rank, started and stopped with
the pods, and their counters exported to Prometheus and ``/debug/index``.

Owner: the :class:`KvEventService` owns the subscribers (and through them, the index's contents). A worker
of a host whose indexer applies the events (:mod:`gateway.indexer`) subscribes to nothing: its index reads
the indexer's, and the service only follows what the pods evicted (for keep-warm's free queues) and
exports the indexer's counters, which it mirrors into the index for the workers to read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.background import LoopShare, allow_sockets, cancel_and_wait
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriber import KvEventSubscriber, SubscriberStats
from gateway.pods.registry import Pod

log = logging.getLogger("gateway.kv")

# How often a worker reading the host's index tells its free queues what the pods evicted.
FOLLOW_NOTES_S = 0.01
COUNTERS = SubscriberStats.__slots__  # mirrored into the index, in this order, for the workers to read


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel rank r publishes on the base port + r."""
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


@dataclass(slots=True)
class ViewState:
    """What is exported of one pod's rank: its subscriber's counters (here or the host indexer's) and view."""

    pod: str
    rank: int
    counters: dict[str, int]
    approximate: bool
    blocks: int
    evictions: int


class KvEventService:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._subscribers: dict[str, list[KvEventSubscriber]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._follower: asyncio.Task[None] | None = None
        self.loop_share = LoopShare()

    @property
    def subscribes(self) -> bool:
        """False in a worker whose host's indexer applies the events."""
        return self.index.writes

    def add_pod(self, pod: Pod) -> None:
        cfg = pod.config
        if not self.subscribes:
            if self._follower is None:
                self._follower = asyncio.create_task(self._follow_notes(), name="kv-eviction-notes")
            return
        if not cfg.kv_events:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            allow_sockets(self._ctx, 65_536)  # a subscriber and its connection monitor per pod and rank
        model = next((c["id"] for c in pod.model_cards if not c.get("parent")), None) or \
            (cfg.models[0] if cfg.models else "")
        subs = self._subscribers.setdefault(pod.name, [])
        for rank in range(cfg.dp_size):
            view = self.index.view(pod.name, rank, str(model), cfg.block_size)
            sub = KvEventSubscriber(
                self.index, view, rank_endpoint(cfg.kv_events, rank),
                rank_endpoint(cfg.kv_replay, rank) if cfg.kv_replay else None,
                topic=cfg.kv_topic, context=self._ctx, loop_share=self.loop_share,
            )
            sub.start()
            subs.append(sub)
        log.info("subscribed to KV events of pod %s (%s, %d rank(s))", pod.name, cfg.kv_events, cfg.dp_size)

    async def remove_pod(self, name: str) -> None:
        for sub in self._subscribers.pop(name, []):
            await sub.stop()
        self.index.drop_pod(name)

    def pod_health_changed(self, pod: Pod) -> None:
        if not pod.healthy:
            for sub in self._subscribers.get(pod.name, []):
                sub.pod_lost()

    async def _follow_notes(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_NOTES_S)
            try:
                self.index.follow_notes()
            except Exception:  # a bug here must not stop the free queues from following for good
                log.exception("following the host index's eviction notes failed")

    async def stop(self) -> None:
        await cancel_and_wait(self._follower)
        # All at once: one by one, each waits a turn of a loop that a thousand pods' events keep busy (26 s
        # to stop 1,000 subscriptions under a firehose of 600k block events/s; the whole gateway stops in 1.3 s now).
        subs = self.subscribers()
        for sub, outcome in zip(subs, await asyncio.gather(*(s.stop() for s in subs), return_exceptions=True),
                                strict=True):
            if isinstance(outcome, BaseException):
                log.error("pod %s rank %d: its KV-event subscription failed to stop: %r", sub.view.pod,
                          sub.view.rank, outcome)
        self._subscribers.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes what a failed stop left open: term() would wait for it forever
            self._ctx = None

    def subscribers(self) -> list[KvEventSubscriber]:
        return [sub for subs in self._subscribers.values() for sub in subs]

    def mirror_counters(self) -> None:
        """Copy each subscriber's counters into the index (the host's indexer: for the workers to export)."""
        for sub in self.subscribers():
            sub.view.store.set_counters(sub.view.bit, [getattr(sub.stats, name) for name in COUNTERS])

    def view_states(self) -> Iterator[ViewState]:
        if self.subscribes:
            for sub in self.subscribers():
                view = sub.view
                yield ViewState(view.pod, view.rank, {name: getattr(sub.stats, name) for name in COUNTERS},
                                view.approximate, view.blocks, view.evictions)
            return
        for view in self.index.views():
            try:
                counters = dict(zip(COUNTERS, view.store.counters(view.bit), strict=False))
                yield ViewState(view.pod, view.rank, counters, view.approximate, view.blocks, view.evictions)
            except KeyError:  # dropped by the indexer meanwhile
                continue

    def debug(self) -> dict[str, Any]:
        subs = {(s.view.pod, s.view.rank): s for s in self.subscribers()}
        views = []
        for view in self.index.views():
            try:
                sub = subs.get(view.key)
                views.append({
                    "pod": view.pod, "rank": view.rank, "model": view.model, "block_size": view.block_size,
                    "blocks": view.blocks, "engine_hashes": view.engine_hashes, "approximate": view.approximate,
                    "last_seq": view.last_seq,
                    "subscriber": None if sub is None else {"endpoint": sub.endpoint, "replay": sub.replay_endpoint,
                                                            **{k: getattr(sub.stats, k) for k in COUNTERS}},
                })
            except KeyError:
                continue
        return {"views": views, "index": {k: getattr(self.index.stats, k) for k in self.index.stats.__slots__},
                "indexed_blocks": self.index.size(), "applied_here": self.subscribes,
                "memory": self.index.memory(), "eviction_notes_lost": self.index.notes_lost}


class KvMetricsCollector(Collector):
    """Reads the subscribers' and index's counters at scrape time: nothing is updated per event. A worker
    reading the host's index exports the host indexer's counters only if it is the first worker
    (``exports_host``): ``/metrics`` sums the workers' counters."""

    def __init__(self, service: KvEventService, exports_host: bool = True) -> None:
        self._service = service
        self._exports = service.subscribes or exports_host

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        if not self._exports:
            return
        events = CounterMetricFamily("gateway_kv_event_batches", "KV-event batches by pod and outcome",
                                     labels=["pod", "rank", "outcome"])
        recovery = CounterMetricFamily("gateway_kv_event_recovery", "Gaps, replays and restarts seen",
                                       labels=["pod", "rank", "kind"])
        approximate = GaugeMetricFamily("gateway_kv_view_approximate", "1 when a pod's index lost events for good",
                                        labels=["pod", "rank"])
        blocks = GaugeMetricFamily("gateway_kv_indexed_blocks", "Blocks in the prefix index", labels=["pod", "rank"])
        evictions = CounterMetricFamily("gateway_kv_evictions", "Cached blocks the pod evicted (BlockRemoved)",
                                        labels=["pod", "rank"])
        for state in self._service.view_states():
            pod, rank, s = state.pod, str(state.rank), state.counters
            # Outcomes and kinds that never happened to the pod are left out (absent: zero): a fleet of a
            # thousand pods would otherwise expose ten series a pod, mostly zeros.
            for outcome in ("batches", "applied", "duplicates", "malformed"):
                if n := s.get(outcome, 0):
                    events.add_metric([pod, rank, outcome], n)
            for kind in ("gaps", "replays", "replay_failures", "replay_holes", "restarts", "unrecoverable"):
                if n := s.get(kind, 0):
                    recovery.add_metric([pod, rank, kind], n)
            approximate.add_metric([pod, rank], 1.0 if state.approximate else 0.0)
            blocks.add_metric([pod, rank], state.blocks)
            evictions.add_metric([pod, rank], state.evictions)
        stats = self._service.index.stats
        index = CounterMetricFamily("gateway_kv_index_blocks", "Block operations applied to the index",
                                    labels=["op"])
        for op in ("blocks_stored", "blocks_removed", "clears", "unknown_parent", "unknown_removed", "rejected",
                   "evicted_for_memory"):
            index.add_metric([op], getattr(stats, op))
        yield from (events, recovery, approximate, blocks, evictions, index)
