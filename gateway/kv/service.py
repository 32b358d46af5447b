"""Wires KV events to the prefix index: one subscriber per pod and DP rank, started and stopped with
the pods, and their counters exported to Prometheus and ``/debug/index``.

Owner: the :class:`KvEventService` owns the subscribers (and through them, the index's contents).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.backends.registry import Pod
from gateway.background import LoopShare
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriber import KvEventSubscriber, SubscriberStats

log = logging.getLogger("gateway.kv")


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel rank r publishes on the base port + r."""
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


class KvEventService:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._subscribers: dict[tuple[str, int], KvEventSubscriber] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self.loop_share = LoopShare()

    def add_pod(self, pod: Pod) -> None:
        cfg = pod.config
        if not cfg.kv_events:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        model = next((c["id"] for c in pod.model_cards if not c.get("parent")), None) or \
            (cfg.models[0] if cfg.models else "")
        for rank in range(cfg.dp_size):
            view = self.index.view(pod.name, rank, str(model), cfg.block_size)
            sub = KvEventSubscriber(
                self.index, view, rank_endpoint(cfg.kv_events, rank),
                rank_endpoint(cfg.kv_replay, rank) if cfg.kv_replay else None,
                topic=cfg.kv_topic, context=self._ctx, loop_share=self.loop_share,
            )
            sub.start()
            self._subscribers[(pod.name, rank)] = sub
        log.info("subscribed to KV events of pod %s (%s, %d rank(s))", pod.name, cfg.kv_events, cfg.dp_size)

    async def remove_pod(self, name: str) -> None:
        for key in self._keys_of(name):
            await self._subscribers.pop(key).stop()
        self.index.drop_pod(name)

    def pod_health_changed(self, pod: Pod) -> None:
        if not pod.healthy:
            for key in self._keys_of(pod.name):
                self._subscribers[key].pod_lost()

    def _keys_of(self, pod: str) -> list[tuple[str, int]]:
        return [key for key in self._subscribers if key[0] == pod]

    async def stop(self) -> None:
        for sub in self._subscribers.values():
            await sub.stop()
        self._subscribers.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def subscribers(self) -> list[KvEventSubscriber]:
        return list(self._subscribers.values())

    def debug(self) -> dict[str, Any]:
        views = []
        for view in self.index.views():
            sub = self._subscribers.get(view.key)
            views.append({
                "pod": view.pod, "rank": view.rank, "model": view.model, "block_size": view.block_size,
                "blocks": view.blocks, "engine_hashes": view.engine_hashes,
                "approximate": view.approximate, "last_seq": view.last_seq,
                "subscriber": None if sub is None else {"endpoint": sub.endpoint, "replay": sub.replay_endpoint,
                                                        **{k: getattr(sub.stats, k)
                                                           for k in SubscriberStats.__slots__}},
            })
        return {"views": views, "index": {k: getattr(self.index.stats, k) for k in self.index.stats.__slots__},
                "indexed_blocks": self.index.size()}


class KvMetricsCollector(Collector):
    """Reads the subscribers' and index's counters at scrape time: nothing is updated per event."""

    def __init__(self, service: KvEventService) -> None:
        self._service = service

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        events = CounterMetricFamily("gateway_kv_event_batches", "KV-event batches by pod and outcome",
                                     labels=["pod", "rank", "outcome"])
        recovery = CounterMetricFamily("gateway_kv_event_recovery", "Gaps, replays and restarts seen",
                                       labels=["pod", "rank", "kind"])
        approximate = GaugeMetricFamily("gateway_kv_view_approximate", "1 when a pod's index lost events for good",
                                        labels=["pod", "rank"])
        blocks = GaugeMetricFamily("gateway_kv_indexed_blocks", "Blocks in the prefix index", labels=["pod", "rank"])
        evictions = CounterMetricFamily("gateway_kv_evictions", "Cached blocks the pod evicted (BlockRemoved)",
                                        labels=["pod", "rank"])
        for sub in self._service.subscribers():
            pod, rank, s = sub.view.pod, str(sub.view.rank), sub.stats
            for outcome in ("batches", "applied", "duplicates", "malformed"):
                events.add_metric([pod, rank, outcome], getattr(s, outcome))
            for kind in ("gaps", "replays", "replay_failures", "replay_holes", "restarts", "unrecoverable"):
                recovery.add_metric([pod, rank, kind], getattr(s, kind))
            approximate.add_metric([pod, rank], 1.0 if sub.view.approximate else 0.0)
            blocks.add_metric([pod, rank], sub.view.blocks)
            evictions.add_metric([pod, rank], sub.view.evictions)
        stats = self._service.index.stats
        index = CounterMetricFamily("gateway_kv_index_blocks", "Block operations applied to the index",
                                    labels=["op"])
        for op in ("blocks_stored", "blocks_removed", "clears", "unknown_parent", "unknown_removed", "rejected",
                   "evicted_for_memory"):
            index.add_metric([op], getattr(stats, op))
        yield from (events, recovery, approximate, blocks, evictions, index)
