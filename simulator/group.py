"""Many simulated pods in one process (``gateway mock --pods N``): a fleet of hundreds on a small machine.

Each pod is a whole :class:`~simulator.pod.MockPod` with its own HTTP port, KV-event PUB and replay
sockets, metrics, engine and KV cache, so a gateway sees N pods exactly as it would see N processes: the
same wire formats, block events and replay. What they share is what a process has once: the tokenizer (its
vocabulary and chat template), the ZeroMQ context and its I/O thread, and the event loop.

What is coarser than one pod per process: the engines' steps all run on one event loop, so a step is late
by whatever the other pods' HTTP handling and steps took meanwhile (the simulated TTFT, ``/debug/ttft``, is
what the pod took, lateness included); an idle pod costs nothing but memory (its engine waits for work).

Owner: a :class:`MockPodGroup` owns its pods and stops them all, each even if another fails to stop.
"""

from __future__ import annotations

import asyncio
import errno
import logging

import msgspec
import zmq
import zmq.asyncio

from gateway.background import allow_sockets, raise_open_files_limit
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from simulator.firehose import Firehose
from simulator.pod import MockPod, MockPodConfig
from simulator.ports import PodEndpoints

log = logging.getLogger("simulator")

# Pods started at once: each binds three ports; many at once only queue on the loop.
START_BATCH = 64
BIND_ATTEMPTS = 3


class MockPodGroup:
    def __init__(self, config: MockPodConfig, count: int, tokenizer: HfTokenizer | None = None,
                 synthetic_events: float = 0.0, synthetic_hold: int = 64) -> None:
        """``synthetic_events``: block events a second each pod publishes with no requests (the firehose:
        :mod:`simulator.firehose`), holding ``synthetic_hold`` batches of blocks."""
        self.config = config
        self.count = count
        self.tokenizer = tokenizer or HfTokenizer(config.tokenizer or BUNDLED_TOKENIZER_DIR)
        self.pods: list[MockPod] = []
        self._synthetic = (synthetic_events, synthetic_hold)
        self.firehose: Firehose | None = None

    def _config_of(self, index: int) -> MockPodConfig:
        """Pod ``index``'s config: the group's, its ports counted from the group's (0: any free port)."""
        c = self.config

        def nth(port: int | None, step: int) -> int | None:
            return port + step * index if port else port

        # Events and replay ports interleave (5557, 5558 for the first pod; 5559, 5560 for the next).
        return msgspec.structs.replace(c, port=nth(c.port, 1) or 0, events_port=nth(c.events_port, 2),
                                       replay_port=nth(c.replay_port, 2))

    async def start(self) -> list[PodEndpoints]:
        raise_open_files_limit()
        allow_sockets(zmq.asyncio.Context.instance(), 4 * self.count + 1024)
        try:
            for first in range(0, self.count, START_BATCH):
                batch = range(first, min(self.count, first + START_BATCH))
                self.pods += await asyncio.gather(*(self._start_one(i) for i in batch))
        except BaseException:
            await self.stop()
            raise
        rate, hold = self._synthetic
        publishers = [pod.publisher for pod in self.pods if pod.publisher is not None]
        if rate > 0 and publishers:
            self.firehose = Firehose(publishers, rate, hold=hold, block_size=self.config.block_size)
            self.firehose.start()
        return self.endpoints()

    async def _start_one(self, index: int) -> MockPod:
        config = self._config_of(index)
        for attempt in range(BIND_ATTEMPTS):
            pod = MockPod(config, self.tokenizer)
            try:
                await pod.start()
                return pod
            except (OSError, zmq.ZMQError) as exc:
                # A port chosen free was taken before it was bound: try other ports (chosen ones: give up).
                await pod.stop()
                chosen = config.port or config.events_port or config.replay_port
                if getattr(exc, "errno", None) != errno.EADDRINUSE or chosen or attempt == BIND_ATTEMPTS - 1:
                    raise
                log.warning("mock pod %d: %s; retrying on other ports", index, exc)
        raise AssertionError("unreachable")

    def endpoints(self) -> list[PodEndpoints]:
        out = []
        for i, pod in enumerate(self.pods):
            pub = pod.publisher
            out.append(PodEndpoints(i, pod.url, pub.endpoint if pub else None, pub.replay_endpoint if pub else None))
        return out

    async def stop(self) -> None:
        if self.firehose is not None:
            await self.firehose.stop()
        for pod in self.pods:
            try:
                await pod.stop()
            except Exception:  # every pod is stopped, whatever one of them raises
                log.exception("stopping mock pod %s failed", pod.url)
        self.pods = []
