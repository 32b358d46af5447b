"""The simulated pod's KV-event publisher: a ZMQ PUB socket plus a ROUTER replay endpoint.

Owner: one :class:`KvEventPublisher` per simulated pod (and DP rank); it owns the seq counter and the
bounded replay buffer. Fault switches let tests lose batches in transit (they stay replayable, as with
a real network loss), stop sending altogether, or restart (seq back to 0, buffer emptied).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from collections import deque

import zmq
import zmq.asyncio

from gateway.background import cancel_and_wait
from gateway.kv.events import (
    Encoding,
    EventBatch,
    KvEvent,
    decode_seq,
    encode_batch,
    encode_seq,
    replay_end,
    replay_message,
)

log = logging.getLogger("simulator.events")


def _bind(sock: zmq.Socket, endpoint: str, attempts: int = 50) -> None:
    """Bind, waiting briefly for a port that a restart's just-closed socket still holds (ZeroMQ closes
    sockets in its I/O thread, after ``close`` has returned)."""
    for attempt in range(attempts):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == attempts - 1:
                raise
            time.sleep(0.02)


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        encoding: Encoding = Encoding.CURRENT,
        dp_rank: int | None = None,
        buffer_steps: int = 10_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.encoding = encoding
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.drop_fraction = 0.0
        self.sending = True
        self.batches_sent = 0
        self.batches_dropped = 0
        self.rng = random.Random()  # which batches drop_fraction drops (tests seed it)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        # A plain (synchronous) socket: publishing is a non-blocking call made from the engine's step.
        self._pub = zmq.Socket(self._ctx, zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind(self._pub, self.endpoint)
        if self.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            _bind(self._router, self.replay_endpoint)
            self._replay_task = asyncio.create_task(self._serve_replay(), name="mock-replay")

    async def stop(self) -> None:
        await cancel_and_wait(self._replay_task)
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)

    def publish(self, events: list[KvEvent]) -> None:
        self.publish_payload(encode_batch(EventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank),
                                          self.encoding))

    def publish_payload(self, payload: bytes) -> None:
        """Publish one batch already encoded in this publisher's encoding (the synthetic firehose's)."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not self.sending or (self.drop_fraction and self.rng.random() < self.drop_fraction):
            self.batches_dropped += 1
            return
        assert self._pub is not None
        try:
            # PUB never blocks: past the high-water mark ZMQ drops, as the real publisher does.
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
            self.batches_sent += 1
        except zmq.ZMQError as exc:
            self.batches_dropped += 1
            log.warning("dropping event batch %d: %s", seq, exc)

    def restart(self) -> None:
        """What a subscriber sees when the engine restarts: seq from 0 again, nothing to replay."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 3 or len(frames[-1]) != 8:
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], decode_seq(frames[-1])
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._router.send_multipart(
                        [identity, *replay_message(self.topic, seq, payload, self.encoding)]
                    )
            await self._router.send_multipart([identity, *replay_end(self.encoding)])
