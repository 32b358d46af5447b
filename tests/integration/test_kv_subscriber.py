"""The KV-event subscriber over real ZMQ sockets: order, gaps, replay, restarts, garbage."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from gateway.background import LoopShare
from gateway.kv.events import BlockStored, Encoding, decode_seq, encode_seq
from gateway.kv.hashing import namespace_root, prefix_hashes
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriber import KvEventSubscriber
from simulator.pod import free_port
from simulator.publisher import KvEventPublisher
from tests.conftest import eventually

BS = 4


def block(i: int, parent: int | None = None) -> BlockStored:
    """Block ``i`` of a chain of 4-token blocks with engine hashes 1000 + i."""
    return BlockStored([1000 + i], parent, list(range(i * BS, (i + 1) * BS)), BS)


def chain_hashes(n: int) -> set[int]:
    return set(prefix_hashes(namespace_root("m"), list(range(n * BS)), BS))


class Rig:
    def __init__(self, encoding: Encoding = Encoding.CURRENT, replay: bool = True,
                 replay_endpoint: str | None = None, replay_timeout_s: float = 1.0) -> None:
        """``replay_endpoint``: where the subscriber asks for replays, instead of the publisher's own."""
        self.pub = KvEventPublisher(f"tcp://127.0.0.1:{free_port()}",
                                    f"tcp://127.0.0.1:{free_port()}" if replay else None,
                                    topic="kv", encoding=encoding)
        self.index = PrefixIndex()
        self.view = self.index.view("p", 0, "m", BS)
        self.sub = KvEventSubscriber(self.index, self.view, self.pub.endpoint,
                                     replay_endpoint or self.pub.replay_endpoint, topic="kv",
                                     replay_timeout_s=replay_timeout_s)
        self.n = 0

    def store_next(self) -> None:
        self.pub.publish([block(self.n, 1000 + self.n - 1 if self.n else None)])
        self.n += 1

    def held(self) -> set[int]:
        return self.index.own_hashes("p")

    async def close(self) -> None:
        await self.sub.stop()
        await self.pub.stop()


@pytest.fixture
async def rig_factory():
    rigs: list[Rig] = []

    def make(**kw) -> Rig:
        rig = Rig(**kw)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        await rig.close()


async def connected(rig: Rig) -> None:
    rig.pub.start()
    rig.sub.start()
    await asyncio.sleep(0.3)  # the subscription reaches the publisher (ZMQ slow joiner)


async def three_batches_applied(rig: Rig) -> None:
    await connected(rig)
    for _ in range(3):
        rig.store_next()
    await eventually(lambda: rig.view.last_seq == 2)


@pytest.mark.parametrize("encoding", [Encoding.CURRENT, Encoding.V0_25, Encoding.V0_23, Encoding.SGLANG])
async def test_gap_is_filled_by_replay(rig_factory, encoding):
    rig = rig_factory(encoding=encoding)
    await connected(rig)
    rig.store_next()
    await eventually(lambda: rig.view.last_seq == 0)
    rig.pub.drop_fraction = 1.0  # lost in transit, still in the replay buffer
    rig.store_next()
    rig.store_next()
    rig.pub.drop_fraction = 0.0
    rig.store_next()
    await eventually(lambda: rig.view.last_seq == 3)
    assert rig.held() == chain_hashes(4)
    assert rig.sub.stats.gaps == 1 and rig.sub.stats.replays >= 2 and not rig.view.approximate


async def test_gap_without_replay_marks_approximate_until_clear(rig_factory):
    from gateway.kv.events import AllBlocksCleared

    rig = rig_factory(replay=False)
    await connected(rig)
    rig.store_next()
    await eventually(lambda: rig.view.last_seq == 0)
    rig.pub.sending = False
    rig.store_next()
    rig.pub.sending = True
    rig.store_next()
    await eventually(lambda: rig.view.last_seq == 2)
    assert rig.view.approximate and rig.sub.stats.unrecoverable == 1
    assert rig.held() == chain_hashes(1)  # block 2's parent was never seen: not indexed
    rig.pub.publish([AllBlocksCleared()])
    await eventually(lambda: rig.view.last_seq == 3)
    assert not rig.view.approximate and rig.held() == set()


async def test_restart_drops_the_view_and_rebuilds(rig_factory):
    rig = rig_factory()
    await three_batches_applied(rig)
    assert rig.held() == chain_hashes(3)
    rig.pub.restart()
    rig.pub.publish([block(0)])  # a new engine, a new cache: seq 0 again
    await eventually(lambda: rig.sub.stats.restarts == 1 and rig.view.last_seq == 0)
    assert rig.held() == chain_hashes(1)


async def test_lost_pod_is_forgotten_at_once_and_a_restart_is_still_recognised(rig_factory):
    rig = rig_factory()
    await three_batches_applied(rig)
    rig.sub.pod_lost()
    assert rig.held() == set()  # before any event says so: the pod is gone
    rig.pub.restart()
    rig.pub.publish([block(0)])
    await eventually(lambda: rig.view.last_seq == 0)
    assert rig.sub.stats.restarts == 1 and rig.held() == chain_hashes(1) and not rig.view.approximate


async def test_lost_pod_back_without_restart_is_reread_from_its_replay_buffer(rig_factory):
    rig = rig_factory()
    await three_batches_applied(rig)
    rig.sub.pod_lost()
    rig.store_next()  # the same engine, seq 3: its earlier blocks are still cached
    await eventually(lambda: rig.view.last_seq == 3)
    assert rig.held() == chain_hashes(4)
    assert rig.sub.stats.restarts == 0 and not rig.view.approximate


async def test_restarted_engine_is_read_back_when_the_connection_reopens(rig_factory):
    rig = rig_factory()
    await three_batches_applied(rig)
    await rig.pub.stop()  # the engine dies
    rig.sub.pod_lost()
    rig.pub.restart()
    rig.n = 0
    rig.pub.start()
    rig.pub.sending = False  # its first batches go out before the subscriber is back: only replay has them
    rig.store_next()
    rig.store_next()
    # No live batch needed. The replay applies batches as they come and tells a restart only at its end.
    await eventually(lambda: rig.view.last_seq == 1 and rig.sub.stats.restarts == 1)
    assert rig.held() == chain_hashes(2) and not rig.view.approximate


async def test_subscriber_started_late_catches_up_by_replay(rig_factory):
    rig = rig_factory()
    rig.pub.start()
    for _ in range(5):
        rig.store_next()  # nobody listening yet
    rig.sub.start()
    await eventually(lambda: rig.view.last_seq == 4)
    assert rig.held() == chain_hashes(5)
    rig.store_next()
    await eventually(lambda: rig.view.last_seq == 5)
    assert rig.held() == chain_hashes(6) and rig.sub.stats.restarts == 0
    # Replayed batches are received batches too: every one counted is applied, a duplicate or malformed.
    stats = rig.sub.stats
    assert stats.applied == 6 and stats.batches == stats.applied + stats.duplicates + stats.malformed


async def test_live_copies_of_a_first_replay_stay_duplicates_after_a_second_replay(rig_factory):
    """A live batch reaches a new subscriber before its connection's catch-up: the gap before it is replayed,
    then the catch-up replays what came since. Live copies of the first replay still queued are duplicates,
    not an engine restart (which would drop the pod's view and rebuild it: every pod of a busy fleet did)."""
    rig = rig_factory()
    rig.pub.start()  # the subscriber is driven by hand: no socket of its own
    for _ in range(6):
        rig.store_next()

    def live(seq: int) -> list[bytes]:
        return [rig.pub.topic, encode_seq(seq), dict(rig.pub.buffer)[seq]]

    await rig.sub.handle(live(3))  # seqs 0..2 are a gap: replayed, with 3..5
    assert rig.view.last_seq == 5
    rig.store_next()
    await rig.sub._catch_up()  # the connection's catch-up: replays 6
    assert rig.view.last_seq == 6
    await rig.sub.handle(live(4))  # still queued from before the catch-up
    stats = rig.sub.stats
    assert stats.restarts == 0 and stats.duplicates == 1 and rig.held() == chain_hashes(7)


async def test_publisher_down_at_start_then_up(rig_factory):
    rig = rig_factory(replay=False)
    rig.sub.start()
    await asyncio.sleep(0.3)
    rig.pub.start()
    await asyncio.sleep(0.5)  # ZMQ reconnects on its own
    rig.store_next()
    await eventually(lambda: rig.view.last_seq == 0)
    assert rig.held() == chain_hashes(1) and not rig.view.approximate


async def test_garbage_is_counted_and_the_subscriber_keeps_going(rig_factory):
    rig = rig_factory(replay=False)
    await connected(rig)
    sock = rig.pub._pub  # the publisher's own socket, to send what no engine would
    assert sock is not None
    sock.send_multipart([b"kv", encode_seq(0), b"\xc1\xff garbage"])
    sock.send_multipart([b"kv", b"short", b""])
    sock.send_multipart([b"kv", encode_seq(1)])
    sock.send_multipart([b"kv", encode_seq(1), b"\x93\x00\x90\x00"])  # [0, [], 0]: a valid empty batch
    await eventually(lambda: rig.view.last_seq == 1)
    assert rig.sub.stats.malformed == 3 and rig.sub.stats.applied == 1
    rig.pub.seq = 2
    rig.store_next()
    await eventually(lambda: rig.view.last_seq == 2)
    assert rig.held() == chain_hashes(1)


async def test_replay_endpoint_that_never_answers(rig_factory):
    import zmq
    import zmq.asyncio

    from simulator.pod import free_port

    silent = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    silent.bind(f"tcp://127.0.0.1:{free_port()}")
    rig = rig_factory(replay_endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT), replay_timeout_s=0.2)
    try:
        await connected(rig)
        rig.store_next()
        rig.pub.drop_fraction = 1.0
        rig.store_next()
        rig.pub.drop_fraction = 0.0
        rig.store_next()
        await eventually(lambda: rig.view.last_seq == 2)
        assert rig.view.approximate and rig.sub.stats.replay_failures >= 1
        rig.store_next()  # and it keeps going
        await eventually(lambda: rig.view.last_seq == 3)
    finally:
        silent.close(linger=0)


async def test_catching_up_on_a_warm_pod_gives_the_loop_back(rig_factory):
    """A warm pod's replay arrives without the subscriber ever waiting: it must still let other work
    (requests) run between batches, not apply thousands of them in one go."""
    rig = rig_factory()
    rig.pub.buffer = deque(maxlen=5_000)
    rig.pub.start()
    rig.pub.sending = False  # the engine ran before the gateway came: everything is in its replay buffer
    for _ in range(3_000):
        rig.store_next()
    share = LoopShare(budget_s=0.001)
    # The replay's deadline is not what this measures: 0.13 s here, but in a full suite beside other load it
    # once passed 5 s, and a timed-out replay leaves the view approximate with nothing more to read.
    sub = KvEventSubscriber(rig.index, rig.view, rig.pub.endpoint, rig.pub.replay_endpoint, topic="kv",
                            replay_timeout_s=120.0, loop_share=share)
    seen: list[int] = []

    async def other_work() -> None:
        while rig.view.last_seq < 2_999:
            seen.append(rig.view.last_seq)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(other_work())
    sub.start()
    try:
        await eventually(lambda: rig.view.last_seq == 2_999, within_s=180)
        await watcher
    finally:
        await sub.stop()
    assert share.yields > 0
    assert any(0 < seq < 2_999 for seq in seen)  # other work ran in the middle of the catch-up
    assert rig.held() == chain_hashes(3_000)


async def test_a_burst_of_live_batches_queued_at_once_is_applied_in_order_and_gives_the_loop_back(rig_factory):
    """Batches already waiting on the socket are taken one by one without a wait (a pod publishes one per
    engine step): none is lost or taken out of order (either would be a gap, replayed), and other work
    still runs between them."""
    rig = rig_factory()
    await three_batches_applied(rig)
    replays = rig.sub.stats.replays
    for _ in range(2_000):
        rig.store_next()
    seen: list[int] = []

    async def other_work() -> None:
        while rig.view.last_seq < 2_002:
            seen.append(rig.view.last_seq)
            await asyncio.sleep(0)

    await asyncio.wait_for(other_work(), 30)
    assert rig.held() == chain_hashes(2_003)
    assert rig.sub.stats.gaps == 0 and rig.sub.stats.replays == replays and rig.sub.stats.duplicates == 0
    assert any(2 < seq < 2_002 for seq in seen)  # other work ran in the middle of the burst


async def test_a_replay_that_lost_batches_on_the_way_is_asked_again_from_the_hole(rig_factory):
    """A ROUTER past its send high-water mark drops what its peer has not taken (a warm pod replays
    thousands of batches at once): the subscriber asks again from the first missing batch."""
    import time

    import zmq

    from gateway.kv.events import EventBatch, encode_batch, replay_end, replay_message

    payloads = [encode_batch(EventBatch(ts=time.time(), events=[block(i, 1000 + i - 1 if i else None)]),
                             Encoding.CURRENT) for i in range(4)]
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    asked: list[int] = []

    async def serve() -> None:
        while True:
            identity, *_, start = await router.recv_multipart()
            asked.append(decode_seq(start))
            sent = [0, 1, 3] if len(asked) == 1 else range(asked[-1], 4)  # the first answer lost batch 2
            for seq in sent:
                await router.send_multipart([identity, *replay_message(b"kv", seq, payloads[seq], Encoding.CURRENT)])
            await router.send_multipart([identity, *replay_end(Encoding.CURRENT)])

    rig = rig_factory(replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT))
    server = asyncio.create_task(serve())
    try:
        await connected(rig)
        await eventually(lambda: rig.view.last_seq == 3)
        assert asked == [0, 2]
        assert rig.held() == chain_hashes(4) and rig.sub.stats.replay_holes == 1 and not rig.view.approximate
    finally:
        server.cancel()
        router.close(linger=0)


async def test_batches_gone_from_the_buffer_before_a_second_replay_count_as_one_loss(rig_factory):
    """The catch-up after a first replay finds the pod's buffer starting later than asked: one loss, counted
    once (the first pass's start is the replay's to judge), and the view marked approximate."""
    rig = rig_factory()
    rig.pub.buffer = deque(maxlen=3)
    rig.pub.start()  # the subscriber is driven by hand: no socket of its own
    for _ in range(3):
        rig.store_next()
    await rig.sub.handle([rig.pub.topic, encode_seq(1), dict(rig.pub.buffer)[1]])  # seq 0 a gap: replayed
    assert rig.view.last_seq == 2 and rig.sub.stats.unrecoverable == 0
    for _ in range(5):
        rig.store_next()  # the buffer keeps 5..7: 3 and 4 are gone
    await rig.sub._catch_up()
    stats = rig.sub.stats
    assert rig.view.last_seq == 7 and rig.view.approximate
    assert stats.unrecoverable == 1 and stats.replays == 2
