"""The state bus: the changes each gateway process makes to shared state, sent to every other one.

Owner: the :class:`StateBus` owns the batch being filled, its links and the table of peers heard from.
It owns no routing state: owners publish facts about their own writes through the sink they are built
with, and apply the facts of others through the handlers registered with :meth:`StateBus.on`
(``gateway/cluster/replication.py`` wires both).

Nothing on the request path waits for the bus: :meth:`publish` appends to a list, and the batch goes out
``flush_ms`` later. Between the workers of one replica it goes as one Unix datagram to each sibling
(reliable and ordered on Linux; a sibling whose buffer is full loses it, counted); between replicas it
goes through a Redis pub/sub channel, by a background task. Redis down or slow: batches wait in a
bounded queue (the oldest dropped beyond it) and are sent again a second later, one warning is logged,
``gateway_shared_state_redis_up`` drops to 0, and every replica goes on with its own state until Redis is
back. A publish whose timeout ran out while this process stood still (``LoopLagProbe``) is sent again at
once and blames nobody: Redis may then get it twice, as after any timeout. Every ``heartbeat_s`` a process
sends its in-flight owner counts (and its keys' usage) whole, which repairs any count a lost batch left
wrong; a peer silent for ``peer_timeout_s`` is gone and whatever it had in flight with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.background import cancel_and_wait, own_stall
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.wire import DECODER, ENCODER, Batch
from gateway.config import SharedStateConfig
from gateway.core.facts import Fact

log = logging.getLogger("gateway.cluster")

# Below the default Unix-socket send buffer, so that one batch is one datagram.
MAX_DATAGRAM = 60_000
F = TypeVar("F", bound=Fact)


class BusMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.facts = Counter("gateway_shared_state_facts", "Shared-state facts sent and applied", ["direction"],
                             registry=registry)
        self.sent, self.applied = self.facts.labels("sent"), self.facts.labels("applied")
        self.dropped = Counter("gateway_shared_state_dropped_batches",
                               "Batches of facts lost, by link and cause", ["link", "cause"], registry=registry)
        self.errors = Counter("gateway_shared_state_errors", "Shared-state failures, by link and operation",
                              ["link", "op"], registry=registry)
        self.redis_up = Gauge("gateway_shared_state_redis_up",
                              "1 while the Redis link works (0: down, or no Redis configured)", registry=registry)
        self.peers = Gauge("gateway_shared_state_peers", "Other gateway processes heard from lately",
                           registry=registry)


class StateBus:
    def __init__(self, config: SharedStateConfig, identity: WorkerIdentity, registry: CollectorRegistry,
                 loop_stalled: Callable[[float], float] = lambda since: 0.0) -> None:
        self.config = config
        self.identity = identity
        self.origin = identity.origin
        self.metrics = BusMetrics(registry)
        self._handlers: dict[type[Fact], list[Callable[[str, Any], None]]] = {}
        self._gone: list[Callable[[str], None]] = []
        self._heartbeat: list[Callable[[], Fact | None]] = []
        self._pending: list[Fact] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self.peers: dict[str, float] = {}  # origin → when last heard from (monotonic)
        self._siblings = SiblingLink(identity, self._received, self.metrics) if identity.count > 1 else None
        self._redis = RedisLink(config, self._received, self.metrics, loop_stalled) if config.redis_url else None
        self._task: asyncio.Task[None] | None = None

    @property
    def redis_up(self) -> bool | None:
        """Whether the Redis link works (None: no Redis configured)."""
        return None if self._redis is None else self._redis.up

    @property
    def active(self) -> bool:
        """Whether there is anyone to share with (several workers, or Redis)."""
        return self._siblings is not None or self._redis is not None

    # Wiring

    def on(self, kinds: tuple[type[F], ...], handler: Callable[[str, F], None]) -> None:
        """Apply facts of these kinds from other processes: ``handler(origin, fact)``, after the handlers
        registered before it."""
        for kind in kinds:
            self._handlers.setdefault(kind, []).append(handler)

    def on_peer_gone(self, handler: Callable[[str], None]) -> None:
        self._gone.append(handler)

    def heartbeat_with(self, make: Callable[[], Fact | None]) -> None:
        """A fact every heartbeat carries (a snapshot that repairs what lost batches left wrong)."""
        self._heartbeat.append(make)

    # Sending

    def publish(self, fact: Fact) -> None:
        self._pending.append(fact)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(self.config.flush_ms / 1000, self.flush)

    def tell_siblings(self, fact: Fact) -> None:
        """Send ``fact`` alone to the other workers of this replica, now: a wake-up call, not batched with the
        state (nor sent to other replicas)."""
        if self._siblings is not None:
            self._siblings.send(ENCODER.encode(Batch(self.origin, self.identity.replica, [fact])))
            self.metrics.sent.inc()

    def flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        facts, self._pending = self._pending, []
        for data in self._encode(facts):
            if self._siblings is not None:
                self._siblings.send(data)
            if self._redis is not None:
                self._redis.send(data)
        self.metrics.sent.inc(len(facts))

    def _encode(self, facts: list[Fact]) -> list[bytes]:
        data = ENCODER.encode(Batch(self.origin, self.identity.replica, facts))
        if len(data) <= MAX_DATAGRAM or len(facts) < 2:
            return [data]
        half = len(facts) // 2
        return self._encode(facts[:half]) + self._encode(facts[half:])

    # Receiving

    def _received(self, data: bytes, via_redis: bool) -> None:
        try:
            batch = DECODER.decode(data)
        except msgspec.DecodeError as exc:
            self.metrics.errors.labels("redis" if via_redis else "siblings", "decode").inc()
            log.warning("shared state: undecodable batch dropped (%s)", exc)
            return
        if batch.origin == self.origin or (via_redis and batch.replica == self.identity.replica):
            return  # our own, or a sibling's that came directly
        self.peers[batch.origin] = time.monotonic()
        for fact in batch.facts:
            for handler in self._handlers.get(type(fact), ()):
                try:
                    handler(batch.origin, fact)
                except Exception:  # one bad fact must not stop the others, nor the link
                    self.metrics.errors.labels("redis" if via_redis else "siblings", "apply").inc()
                    log.exception("shared state: applying %s from %s failed", type(fact).__name__, batch.origin)
        self.metrics.applied.inc(len(batch.facts))

    # Lifetime

    async def start(self) -> None:
        if self._siblings is not None:
            self._siblings.start()
        if self._redis is not None:
            self._redis.start()
        if self.active:
            self._task = asyncio.create_task(self._beat(), name="shared-state-heartbeat")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self._pending:
            self.flush()
        if self._redis is not None:
            await self._redis.stop()
        if self._siblings is not None:
            self._siblings.stop()

    async def _beat(self) -> None:
        while True:
            for make in self._heartbeat:
                if (fact := make()) is not None:
                    self.publish(fact)
            self.flush()  # an empty batch still says we are alive
            now = time.monotonic()
            for origin in [o for o, seen in self.peers.items() if now - seen > self.config.peer_timeout_s]:
                del self.peers[origin]
                log.info("shared state: %s is gone; what it had in flight is forgotten", origin)
                for handler in self._gone:
                    handler(origin)
            self.metrics.peers.set(len(self.peers))
            await asyncio.sleep(self.config.heartbeat_s)

    def debug(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "origin": self.origin,
            "redis": None if self._redis is None else {"up": self._redis.up, "queued": len(self._redis.queue)},
            "peers": {origin: round(now - seen, 2) for origin, seen in sorted(self.peers.items())},
        }


class SiblingLink:
    """Unix datagrams to and from the other workers of this replica."""

    def __init__(self, identity: WorkerIdentity, deliver: Callable[[bytes, bool], None], metrics: BusMetrics
                 ) -> None:
        self._path = identity.bus_socket(identity.index)
        self._targets = [identity.bus_socket(i) for i in range(identity.count) if i != identity.index]
        self._deliver = deliver
        self._metrics = metrics
        self._sock: socket.socket | None = None

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.setblocking(False)
        sock.bind(self._path)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._read)

    def stop(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)

    def send(self, data: bytes) -> None:
        if self._sock is None:
            return
        for target in self._targets:
            try:
                self._sock.sendto(data, target)
            except BlockingIOError:
                self._metrics.dropped.labels("siblings", "buffer_full").inc()
            except (FileNotFoundError, ConnectionRefusedError):
                self._metrics.dropped.labels("siblings", "not_listening").inc()  # starting or restarting
            except OSError as exc:
                self._metrics.errors.labels("siblings", "send").inc()
                log.warning("shared state: sending to %s failed: %s", target, exc)

    def _read(self) -> None:
        assert self._sock is not None
        for _ in range(64):  # then let the loop run other work
            try:
                data = self._sock.recv(1 << 20)
            except BlockingIOError:
                return
            self._deliver(data, False)


class RedisLink:
    """One Redis pub/sub channel for every process of every replica."""

    def __init__(self, config: SharedStateConfig, deliver: Callable[[bytes, bool], None], metrics: BusMetrics,
                 loop_stalled: Callable[[float], float]) -> None:
        self.config = config
        self._deliver = deliver
        self._metrics = metrics
        self._loop_stalled = loop_stalled
        self._timeouts: tuple[type[BaseException], ...] = (TimeoutError,)
        self.queue: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.up = False
        self._warned = False

    def start(self) -> None:
        import redis.asyncio as redis  # imported only with shared_state.redis_url set
        from redis.exceptions import TimeoutError as RedisTimeout

        self._timeouts = (TimeoutError, RedisTimeout)

        timeout = self.config.redis_timeout_s
        self._client = redis.from_url(self.config.redis_url, socket_timeout=timeout,
                                      socket_connect_timeout=timeout)
        # pub/sub waits for messages indefinitely: no read timeout on its own connection
        self._sub_client = redis.from_url(self.config.redis_url, socket_connect_timeout=timeout)
        self._tasks = [asyncio.create_task(self._publish(), name="shared-state-publish"),
                       asyncio.create_task(self._subscribe(), name="shared-state-subscribe")]

    async def stop(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        for client in (self._client, self._sub_client):
            with contextlib.suppress(Exception):
                await client.aclose()

    def send(self, data: bytes) -> None:
        if len(self.queue) >= self.config.max_pending_batches:
            self.queue.popleft()
            self._metrics.dropped.labels("redis", "queue_full").inc()
        self.queue.append(data)
        self._wake.set()

    def _mark(self, up: bool, op: str = "", exc: BaseException | None = None) -> None:
        if up and not self.up:
            log.info("shared state: Redis link up (%s)", self.config.channel)
            self._warned = False
        if not up:
            self._metrics.errors.labels("redis", op).inc()
            if not self._warned:
                self._warned = True
                log.warning("shared state: Redis unavailable (%s: %s); each replica keeps its own state until "
                            "it is back", op, exc or "timeout")
        self.up = up
        self._metrics.redis_up.set(1 if up else 0)

    async def _publish(self) -> None:
        excused = False
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                started = time.perf_counter()
                try:
                    async with asyncio.timeout(self.config.redis_timeout_s):
                        await self._client.publish(self.config.channel, self.queue[0])
                except Exception as exc:  # redis.RedisError, OSError, the timeout
                    # A timer that ran out while this process stood still measured it, not Redis: at once again.
                    if not excused and isinstance(exc, self._timeouts) and \
                            own_stall(self._loop_stalled, started, self.config.redis_timeout_s) is not None:
                        excused = True
                        continue
                    self._mark(False, "publish", exc)
                    # The batch stays first in the queue. Not sooner: what is published before the other
                    # replicas have subscribed again after an outage reaches nobody.
                    await asyncio.sleep(min(2.0, self.config.redis_timeout_s * 2))
                    excused = False
                    continue
                self.queue.popleft()
                excused = False
                if not self.up:
                    self._mark(True)

    async def _subscribe(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self._sub_client.pubsub()
            try:
                async with asyncio.timeout(self.config.redis_timeout_s):
                    await pubsub.subscribe(self.config.channel)
                self._mark(True)
                backoff = 0.1
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._deliver(message["data"], True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection lost, refused, timed out
                self._mark(False, "subscribe", exc)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)
