"""One :class:`KvEventSubscriber` per pod and DP rank: live events over SUB, gaps filled over DEALER.

Owner: the subscriber owns its SUB socket and its view's sequence state; its :class:`KvEventReplay` owns
the DEALER sockets and what came by replay. The two, one at a time, are the only writer of the view in the
:class:`~gateway.kv.index.PrefixIndex`. Sequence rules:

- ``seq == last + 1``: apply. A seq already applied through replay: drop as a duplicate.
- first message, or a gap: replay from ``last + 1`` (from 0 after connecting: the slow joiner misses
  the start) before applying the live batch; if the replay starts later than asked, the missing
  batches are gone and the view is marked approximate until a clean base returns.
- seq below what was applied (and not a replay duplicate): the engine restarted; drop the view.
- the pod failed its health checks (:meth:`pod_lost`): its blocks are dropped at once. Its next batch,
  by replay or live, rebuilds the view from seq 0; the engine restarted if that seq is not past the
  one it had when lost.

ZeroMQ reconnects a dropped connection by itself (with the backoff set below). A PUB socket drops what
it publishes while nobody is connected, so each time the connection opens (the first time included)
the subscriber asks the replay endpoint for everything after its last seq: a gateway started beside
long-running pods routes precisely at once, and a restarted engine's first batches are not missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from gateway.background import LoopShare, Turn, cancel_and_wait
from gateway.kv.events import END_OF_REPLAY_SEQ, BadEventBatch, decode_seq, encode_seq
from gateway.kv.index import PrefixIndex
from gateway.kv.views import EngineView

log = logging.getLogger("gateway.kv.subscriber")

# Plain ints: pyzmq makes an enum of each flag it is given or returns (a third of what asking costs).
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
REPLAY_PASSES = 3  # requests for one replay with holes in it


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    applied: int = 0
    duplicates: int = 0
    malformed: int = 0
    skipped_events: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    unrecoverable: int = 0
    replay_holes: int = 0  # replays that lost batches on the way (asked again from the hole)


@dataclass(slots=True)
class KvEventReplay:
    """Fills a view's gaps from its pod's replay endpoint (a ROUTER), a DEALER socket of its own per request,
    each batch applied (by the subscriber's ``apply``) as it comes. One per :class:`KvEventSubscriber`, called
    under its lock; it owns its DEALER sockets and :attr:`replayed_from`."""

    index: PrefixIndex
    view: EngineView
    stats: SubscriberStats
    apply: Callable[[int, bytes], None]
    endpoint: str | None
    timeout_s: float
    context: zmq.asyncio.Context
    loop_share: LoopShare
    name: str  # "pod p rank r", for the logs
    # Seqs in [replayed_from, view.last_seq] arrived by replay; their live copies are duplicates. Set here; the
    # subscriber clears it when a live batch goes past it or the view is forgotten.
    replayed_from: int | None = None

    async def fill_gap(self, start: int, live_seq: int) -> None:
        """The live batch ``live_seq`` came after a gap from ``start``."""
        if self.view.last_seq >= 0:
            self.stats.gaps += 1
        if self.endpoint:
            await self._replay(start, live_seq)
        else:
            self._lost(start, live_seq)

    async def catch_up(self) -> None:
        """Replay what the pod published after the view's last seq (all of it for an empty view)."""
        start = self.view.last_seq + 1
        try:
            await self._replay(start)
        except zmq.ZMQError as exc:
            log.warning("%s: replay from %d failed: %s", self.name, start, exc)
            self.stats.replay_failures += 1

    def _lost(self, start: int, until: int) -> None:
        self.stats.unrecoverable += 1
        if not self.view.approximate:
            log.warning("%s: event batches %d..%d are lost; index marked approximate", self.name, start, until - 1)
        self.index.mark_approximate(self.view)

    async def _replay(self, start: int, live_seq: int | None = None) -> None:
        """Ask for every buffered batch from ``start`` and apply them; if they begin later than asked, the
        batches before are lost, and if none come, those before the live batch that found the gap.

        A replay endpoint drops what its peer does not take in time (a ROUTER socket past its send
        high-water mark: a warm pod sends thousands of batches at once), so a replay with a hole in it
        is asked again from the hole, a few times; what is still missing is a gap the next live batch
        finds."""
        self.stats.replays += 1
        first, ask = None, start
        for _ in range(REPLAY_PASSES):
            received, hole = await self._replay_pass(ask, first is None)
            first = received if first is None else first
            if hole is None:
                break
            self.stats.replay_holes += 1
            log.info("%s: replay lost batches from %d; asking again", self.name, hole)
            ask = hole
        if first is None:
            self.stats.replay_failures += 1
            if live_seq is not None:
                self._lost(start, live_seq)
        elif first > start:
            self._lost(start, first)

    async def _replay_pass(self, start: int, first_pass: bool) -> tuple[int | None, int | None]:
        """One replay request: the first seq received (if any) and where a hole in the stream began."""
        assert self.endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        try:
            await dealer.send_multipart([b"", encode_seq(start)])
            with self.loop_share.turn() as turn:
                return await self._apply_replayed(dealer, start, turn, first_pass)
        finally:
            dealer.close(linger=0)

    async def _apply_replayed(self, dealer: zmq.asyncio.Socket, start: int, turn: Turn,
                              first_pass: bool) -> tuple[int | None, int | None]:
        first: int | None = None
        try:
            while True:
                await turn.pause()  # a warm pod replays thousands of batches that arrive without waiting
                async with asyncio.timeout(self.timeout_s):
                    frames = await dealer.recv_multipart()
                # [b"", topic, seq, payload] (vLLM >= 0.26, SGLang) or [b"", seq, payload] (older).
                if len(frames) not in (3, 4) or frames[0] != b"":
                    self.stats.malformed += 1
                    continue
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_OF_REPLAY_SEQ or not payload:
                    return (first if first is not None else start), None
                seq = decode_seq(seq_frame)
                self.stats.batches += 1  # every batch received counts, live or replayed: batches >= applied
                if first is None:
                    first = seq  # later than asked: the pod's buffer no longer has the start (the caller says so)
                    if first_pass:  # a later start than asked is the caller's to count
                        if self.replayed_from is None:
                            # The earliest replayed seq: live copies of an earlier replay may still be queued.
                            self.replayed_from = seq
                    elif seq > start:
                        self._lost(start, seq)  # gone from the pod's buffer since the first pass
                elif seq > self.view.last_seq + 1:
                    return first, self.view.last_seq + 1
                if seq > self.view.last_seq:
                    self.apply(seq, payload)
                else:
                    self.stats.duplicates += 1  # already applied live while the replay was on its way
        except TimeoutError:
            log.warning("%s: replay from %d timed out", self.name, start)
            return first, None


class KvEventSubscriber:
    def __init__(
        self,
        index: PrefixIndex,
        view: EngineView,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        on_batch: Callable[[SubscriberStats], None] | None = None,
        loop_share: LoopShare | None = None,
    ) -> None:
        self.index = index
        self.view = view
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.stats = SubscriberStats()
        self._on_batch = on_batch
        # Shared by every subscriber of a gateway: catching up on many pods never holds requests up.
        self._loop_share = loop_share or LoopShare()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._name = f"pod {view.pod} rank {view.rank}"
        self._replay = KvEventReplay(index, view, self.stats, self._apply, replay_endpoint, replay_timeout_s,
                                     self._ctx, self._loop_share, self._name)
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # The last seq applied before the pod was lost; None while it is not.
        self._lost_at: int | None = None
        # Live batches and the replay on (re)connection both write the view: one at a time.
        self._lock = asyncio.Lock()

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay.endpoint

    def start(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1_000)  # a pod that starts is read within a second
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.endpoint)
        self._sub = sub
        name = f"{self.view.pod}-{self.view.rank}"
        self._tasks = [asyncio.create_task(self._receive(), name=f"kv-events-{name}"),
                       asyncio.create_task(self._watch_connection(), name=f"kv-connection-{name}")]

    async def stop(self) -> None:
        await asyncio.gather(*(cancel_and_wait(task) for task in self._tasks))
        if self._sub is not None:
            self._sub.disable_monitor()
            self._sub.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)

    async def _receive(self) -> None:
        assert self._sub is not None
        # The socket without asyncio's wrapping, woken through its file descriptor: pyzmq's asyncio receive
        # makes a future and registers and drops a reader for each batch, which with 1,000 pods publishing a
        # batch per engine step cost more than decoding and applying the batches (py-spy, 300k events/s).
        sock = zmq.Socket.shadow(self._sub.underlying)
        readable = asyncio.Event()
        loop = asyncio.get_running_loop()
        fd = sock.FD
        loop.add_reader(fd, readable.set)
        turn = Turn(self._loop_share)  # mostly waiting: not one of the share's runs
        try:
            while True:
                # ZeroMQ's descriptor tells of a change, not of each batch: take all that is queued first.
                while sock.get(EVENTS) & POLLIN:
                    await self._handle_live(sock.recv_multipart(zmq.NOBLOCK))
                    await turn.pause()  # a burst of queued live batches still lets other work run
                readable.clear()
                if not sock.get(EVENTS) & POLLIN:  # one that came after the last look is not missed
                    await readable.wait()
        finally:
            loop.remove_reader(fd)

    async def _handle_live(self, frames: list[bytes]) -> None:
        async with self._lock:
            try:
                await self.handle(frames)
            except Exception:  # one bad batch must never stop the subscriber
                self.stats.malformed += 1
                log.exception("%s: failed to handle an event batch", self._name)

    async def _watch_connection(self) -> None:
        assert self._monitor is not None
        while True:
            await self._monitor.recv_multipart()  # a handshake succeeded: the only event asked for
            if self.replay_endpoint:
                async with self._lock:
                    await self._catch_up()

    async def handle(self, frames: list[bytes]) -> None:
        """One live message ``[topic, seq, payload]``."""
        self.stats.batches += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return
        seq, payload = decode_seq(frames[1]), frames[2]
        last = self.view.last_seq
        if self._lost_at is not None:
            self._rejoin(seq)
        elif seq > last:
            self._replay.replayed_from = None  # live progress: replay duplicates are behind us
        elif self._replay.replayed_from is not None and seq >= self._replay.replayed_from:
            self.stats.duplicates += 1
            return
        else:
            self._restarted(seq, last)
            self._forget()
            last = -1
        if seq != last + 1:
            await self._replay.fill_gap(last + 1, seq)
        if seq > self.view.last_seq:
            self._apply(seq, payload)

    async def _catch_up(self) -> None:
        """Replay what the pod published after the view's last seq (all of it for an empty view)."""
        await self._replay.catch_up()
        if self._lost_at is not None and self.view.last_seq >= 0:
            self._rejoin(self.view.last_seq + 1)

    def pod_lost(self) -> None:
        """The pod stopped answering: route as if its cache were gone (a dead engine's is)."""
        if self._lost_at is not None:
            return
        if blocks := self.view.blocks:
            log.warning("%s is down: dropping its %d indexed blocks", self._name, blocks)
        self._lost_at = self.view.last_seq
        self._forget()

    def _rejoin(self, next_seq: int) -> None:
        """A lost pod publishes again, batch ``next_seq``: its view, emptied when lost, is rebuilt from seq 0."""
        assert self._lost_at is not None
        if next_seq <= self._lost_at:
            self._restarted(next_seq, self._lost_at)
        else:
            log.info("%s is back without a restart: re-read from its replay buffer", self._name)
        self._lost_at = None

    def _restarted(self, seq: int, before: int) -> None:
        self.stats.restarts += 1
        log.warning("%s restarted (seq %d after %d): rebuilding its index from its events", self._name, seq, before)

    def _forget(self) -> None:
        self.index.reset_view(self.view)
        self.index.record_sequence(self.view, -1)
        self._replay.replayed_from = None

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            skipped = self.index.apply_payload(self.view, payload)
        except BadEventBatch as exc:
            self.stats.malformed += 1
            log.warning("%s: malformed batch %d: %s", self._name, seq, exc)
        else:
            self.stats.skipped_events += skipped
            self.stats.applied += 1
        self.index.record_sequence(self.view, seq)
        if self._on_batch:
            self._on_batch(self.stats)
