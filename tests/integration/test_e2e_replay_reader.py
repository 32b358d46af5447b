"""The e2e suite's reader of a pod's replay endpoint (``tests/e2e/kv_replay.py``), against real ROUTER sockets
on loopback: a real vLLM pod's ROUTER drops batches past its send high-water mark, and the e2e tests that
compare the pod's block pool must still read the whole buffer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import zmq
import zmq.asyncio

from gateway.kv.events import (
    BlockStored,
    Encoding,
    EventBatch,
    decode_seq,
    encode_batch,
    replay_end,
    replay_message,
)
from tests.e2e.kv_replay import ReplayHole, replayed_batches

# What the pod sends for a request from a seq: the seqs, and whether the end marker follows.
Answer = Callable[[int, int], tuple[Sequence[int], bool]]


def payload(seq: int) -> bytes:
    stored = BlockStored(block_hashes=[seq], parent_block_hash=None, token_ids=[seq], block_size=1)
    return encode_batch(EventBatch(ts=time.time(), events=[stored]), Encoding.CURRENT)


class ScriptedPod:
    """A ROUTER that answers the n-th replay request (from 0) for ``start`` with ``answer(n, start)``."""

    def __init__(self, answer: Answer, sndhwm: int | None = None) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        if sndhwm is not None:
            self.socket.setsockopt(zmq.SNDHWM, sndhwm)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.answer = answer
        self.asked: list[int] = []

    async def serve(self) -> None:
        while True:
            identity, *_, start_frame = await self.socket.recv_multipart()
            start = decode_seq(start_frame)
            seqs, ends = self.answer(len(self.asked), start)
            self.asked.append(start)
            for seq in seqs:
                await self.socket.send_multipart([identity, *replay_message(b"kv", seq, payload(seq),
                                                                             Encoding.CURRENT)])
            if ends:
                await self.socket.send_multipart([identity, *replay_end(Encoding.CURRENT)])


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[ScriptedPod], None]]:
    tasks: list[tuple[asyncio.Task[None], ScriptedPod]] = []
    yield lambda pod: tasks.append((asyncio.create_task(pod.serve()), pod))
    for task, pod in tasks:
        task.cancel()
        pod.socket.close(linger=0)


def seqs_of(batches: list[list[object]]) -> list[int]:
    return [event.block_hashes[0] for batch in batches for event in batch]  # type: ignore[attr-defined]


async def test_a_replay_with_holes_is_asked_again_from_each_hole_and_comes_back_whole(serve):
    holes = {0: range(0, 5), 1: range(3, 8)}  # each answer loses two batches in its middle, as a full ROUTER does

    def answer(n: int, start: int) -> tuple[Sequence[int], bool]:
        seqs = [s for s in range(start, 10) if s not in holes.get(n, ())[3:]]
        return seqs, True

    pod = ScriptedPod(answer)
    serve(pod)
    batches = await replayed_batches(pod.endpoint)
    assert seqs_of(batches) == list(range(10))
    assert pod.asked == [0, 3, 6, 10]  # the last: nothing after 9, the end marker alone


async def test_a_pass_whose_end_marker_was_lost_is_asked_again_from_where_it_got_to(serve):
    pod = ScriptedPod(lambda n, start: (range(start, 4) if n else range(0, 2), n > 0))
    serve(pod)
    batches = await replayed_batches(pod.endpoint, quiet_s=0.2)
    # Asked again from 2 (from 1 on a machine so busy that batch 1 came over 0.2 s after batch 0), then from 4.
    assert seqs_of(batches) == [0, 1, 2, 3] and pod.asked[0] == 0 and pod.asked[1:] in ([2, 4], [1, 4])


async def test_a_pod_that_no_longer_buffers_the_batches_after_a_hole_is_an_error_not_a_silent_gap(serve):
    # The first answer ends at a hole; by the second request the pod dropped batches 2..4 from its buffer.
    pod = ScriptedPod(lambda n, start: ([0, 1, 5] if n == 0 else [5, 6], True))
    serve(pod)
    with pytest.raises(ReplayHole, match=r"no longer buffers batches 2\.\.4"):
        await replayed_batches(pod.endpoint)


async def test_a_replay_that_starts_later_than_zero_is_the_oldest_the_pod_still_buffers(serve):
    pod = ScriptedPod(lambda n, start: (range(max(start, 7), 10), True))
    serve(pod)
    assert seqs_of(await replayed_batches(pod.endpoint)) == [7, 8, 9] and pod.asked == [0, 10]


async def test_batches_dropped_just_before_a_delivered_end_marker_are_asked_for_again(serve):
    # A full ROUTER can drop the last batches and still deliver the end marker after them.
    pod = ScriptedPod(lambda n, start: (range(0, 3) if n == 0 else range(start, 5), True))
    serve(pod)
    assert seqs_of(await replayed_batches(pod.endpoint)) == [0, 1, 2, 3, 4] and pod.asked == [0, 3, 5]


async def test_batches_the_pod_sends_from_before_the_seq_asked_for_are_not_taken_twice(serve):
    pod = ScriptedPod(lambda n, start: (range(0, 3), True))  # a pod that ignores the seq asked for
    serve(pod)
    assert seqs_of(await replayed_batches(pod.endpoint)) == [0, 1, 2] and pod.asked == [0, 3]


async def test_a_real_router_past_its_high_water_mark_is_read_whole(serve):
    """A real ROUTER socket with a small send high-water mark, sending thousands of batches at once, drops
    some on the way (how many depends on the machine); the reader still returns every one, in order."""
    pod = ScriptedPod(lambda n, start: (range(start, 2_000), True), sndhwm=100)
    serve(pod)
    # Each pass brings 100 at least; one more may end in a dropped end marker, and one more checks the end.
    batches = await replayed_batches(pod.endpoint, passes=2_000 // 100 + 3)
    assert seqs_of(batches) == list(range(2_000))
    assert pod.asked[0] == 0 and pod.asked == sorted(set(pod.asked))  # each pass from a later hole
