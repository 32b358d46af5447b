"""A synthetic KV-event firehose: every pod of a group publishes block events at a set rate, with no requests,
so that what ingest alone costs a gateway can be measured (``bench/scripts/kv_firehose.py``).

Each pod publishes batches of ``batch`` new blocks (one ``BlockStored``, random tokens: no two pods share a
block) with the removal of the blocks it stored ``hold`` batches earlier (one ``BlockRemoved``), so that
after a warm-up each pod holds ``hold * batch`` blocks and every stored block is later removed, as a pod with
a full cache does. The batches are encoded once, in a cycle the pod goes round (a block stored again after
its removal is a new one to the index), and the ZeroMQ frames are the publisher's own (seq, replay buffer).

Owner: a :class:`Firehose` owns its task; the pods' publishers stay their pods'.
"""

from __future__ import annotations

import asyncio
import random
import time

from gateway.background import cancel_and_wait
from gateway.kv.events import BlockRemoved, BlockStored, EventBatch, encode_batch
from simulator.publisher import KvEventPublisher

TICK_S = 0.005


class Firehose:
    def __init__(self, publishers: list[KvEventPublisher], block_events_per_s: float, batch: int = 16,
                 hold: int = 64, block_size: int = 16, seed: int = 0) -> None:
        """``block_events_per_s``: per pod, stored and removed blocks together."""
        self._publishers = publishers
        self._batches_per_s = block_events_per_s / (2 * batch)
        cycle = hold + 8
        rng = random.Random(seed)
        self._payloads: list[list[bytes]] = []
        for p, pub in enumerate(publishers):
            def hashes(k: int, p: int = p) -> list[int]:
                return [(p << 40) | (k * batch + j + 1) for j in range(batch)]

            payloads = []
            for k in range(cycle):
                tokens = [rng.randrange(1, 30_000) for _ in range(batch * block_size)]
                events = [BlockStored(hashes(k), None, tokens, block_size),
                          BlockRemoved(hashes((k - hold) % cycle))]
                payloads.append(encode_batch(EventBatch(time.time(), events, pub.dp_rank), pub.encoding))
            self._payloads.append(payloads)
        self.sent = 0  # batches
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-firehose")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        pods = len(self._publishers)
        started = time.monotonic()
        turn = 0
        while True:
            await asyncio.sleep(TICK_S)
            due = int((time.monotonic() - started) * self._batches_per_s * pods) - self.sent
            for _ in range(max(0, due)):
                p = turn % pods
                payloads = self._payloads[p]
                self._publishers[p].publish_payload(payloads[(turn // pods) % len(payloads)])
                turn += 1
                self.sent += 1
