"""Reading a real pod's KV-event replay endpoint whole, for the e2e tests that check what the pod stored.

The pod's ROUTER drops what does not fit its send high-water mark (vLLM keeps ZMQ's default, 1,000 messages)
while the reader is taking them, so the replay of a long buffer (a pod that served many tests) comes with
holes: seen on vLLM 0.32, 94 to 197 batches lost after the first 1,000 to 2,500 of a few thousand, or the end
marker alone. Like the gateway's subscriber (``gateway/kv/subscriber.py``), the reader keeps what came and asks again
from the hole; a fresh request starts with an empty pipe, so each pass brings at least a high-water mark's
worth more.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from gateway.kv.events import END_OF_REPLAY_SEQ, KvEvent, decode_batch, decode_seq, encode_seq

PASSES = 20  # vLLM buffers 10,000 batches: 10 passes at the high-water mark, the last one's check, and room


class ReplayHole(Exception):
    """A replay that stayed incomplete: batches the pod no longer buffers, or passes that brought nothing."""


@dataclass
class _Replayed:
    batches: list[list[KvEvent]] = field(default_factory=list)
    next_seq: int = 0  # the first seq not received yet


async def replayed_batches(endpoint: str, passes: int = PASSES, timeout_s: float = 20.0,
                           quiet_s: float = 1.0) -> list[list[KvEvent]]:
    """Every event batch the pod still buffers (one per engine step that made any), in order. A pass waits up
    to ``timeout_s`` for its first batch; once batches flow, ``quiet_s`` without one means the rest, the end
    marker too, was dropped (the pod sends its whole buffer at once), so the next pass asks from there. The
    end marker does not say which seq came last, and the batches just before it may have been dropped while it
    was not: the replay is whole once a pass brings the end marker and nothing before it."""
    replayed = _Replayed()
    for _ in range(passes):
        asked = replayed.next_seq
        if await _replay_pass(endpoint, replayed, timeout_s, quiet_s) and replayed.next_seq == asked:
            return replayed.batches
    raise ReplayHole(f"no whole replay in {passes} passes: batches from {replayed.next_seq} on still missing")


async def _replay_pass(endpoint: str, replayed: _Replayed, timeout_s: float, quiet_s: float) -> bool:
    """One request, from ``replayed.next_seq``: True when it ended with the end marker, False at a hole."""
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)  # no limit on this side: only the pod's send side drops
    dealer.connect(endpoint)
    first_of_pass = True
    try:
        await dealer.send_multipart([b"", encode_seq(replayed.next_seq)])
        while True:
            try:
                async with asyncio.timeout(timeout_s if first_of_pass else quiet_s):
                    frames = await dealer.recv_multipart()
            except TimeoutError:
                return False
            if frames[-2] == END_OF_REPLAY_SEQ or not frames[-1]:
                return True
            seq = decode_seq(frames[-2])
            if seq < replayed.next_seq:  # not asked for: already here
                continue
            if seq > replayed.next_seq and replayed.batches:
                if first_of_pass:  # a pass starts with an empty pipe: its first batch is the oldest buffered
                    raise ReplayHole(f"the pod no longer buffers batches {replayed.next_seq}..{seq - 1}")
                return False  # lost on the way: ask again from the hole
            # (a later seq than asked on the very first batch: the pod's buffer no longer has the oldest ones)
            replayed.batches.append(decode_batch(frames[-1]).events)
            replayed.next_seq, first_of_pass = seq + 1, False
    finally:
        dealer.close(linger=0)
