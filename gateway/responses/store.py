"""Where the gateway keeps the Responses API's responses, so that pods stay stateless and any worker or
replica can continue a conversation (``previous_response_id``) or answer ``GET /v1/responses/{id}``.

A :class:`StoredResponse` is one answered response: the whole input the model saw (the conversation's
earlier items, its earlier outputs, this request's input), the pod's response object as it answered it,
the pod that answered, the conversation it belongs to (the id of its first response), and who may read it
(the API key that created it). With ``responses.store: pods`` only the pod is recorded: the pod keeps the
rest.

Two stores, one interface (:class:`ResponseStore`): :class:`MemoryResponses`, this process's own, bounded by
count and bytes (least recently used first; a response larger than the byte bound is not kept) and by
age; :class:`RedisResponses`, shared by every worker and replica (``shared_state.redis_url``), each
response a key with the same age limit. A gateway of several workers without Redis keeps each response in
the worker that stored it and asks its siblings for the others (:mod:`gateway.cluster.sibling_responses`).

Owner: each store owns its records; the Responses step (:mod:`gateway.request.responses`) writes them as
answers arrive, the Responses routes read and delete them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter

from gateway.config import ResponsesConfig
from gateway.lru import LruCache

log = logging.getLogger("gateway.responses")


class StoredResponse(msgspec.Struct, array_like=True, frozen=True):
    id: str
    pod: str  # the pod's name: the one that answered (and, with the pods' store, keeps it)
    owner: str  # who created it (the API key's name or digest; "" with keys off)
    conversation: str  # the id of the conversation's first response
    created: float  # wall-clock seconds
    input: bytes = b""  # the whole input the model saw: a JSON array of items
    response: bytes = b""  # the pod's response object (JSON), as it answered it

    @property
    def size(self) -> int:
        return len(self.input) + len(self.response) + len(self.id) + 64


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StoredResponse)


def encode(stored: StoredResponse) -> bytes:
    return _encoder.encode(stored)


def decode(data: bytes) -> StoredResponse:
    return _decoder.decode(data)


class StoreUnavailable(Exception):
    """The shared store did not answer (Redis down or slow)."""


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, stored: StoredResponse) -> None: ...

    async def delete(self, response_id: str) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ResponsesMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "gateway_responses", "The Responses API's stored responses: stored, found, not_found, deleted, "
            "expired, evicted, store_failed", ["event"], registry=registry)


class MemoryResponses:
    """This process's responses, at most ``max_responses`` and ``max_bytes`` of them, each for ``ttl_s``."""

    def __init__(self, config: ResponsesConfig, metrics: ResponsesMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self._max_bytes = config.max_bytes
        self._ttl_s = config.ttl_s
        self._clock = clock
        self._metrics = metrics
        self._records: LruCache[str, StoredResponse] = LruCache(config.max_responses)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def find(self, response_id: str) -> StoredResponse | None:
        stored = self._records.touch(response_id)
        if stored is not None and self._clock() - stored.created > self._ttl_s:
            self._forget(response_id, "expired")
            return None
        return stored

    def keep(self, stored: StoredResponse) -> None:
        if stored.size > self._max_bytes:  # it would evict every other response, then itself
            log.warning("response %s (%d bytes) exceeds responses.max_bytes; not kept", stored.id, stored.size)
            self._metrics.events.labels("evicted").inc()
            return
        old = self._records.pop(stored.id, None)
        if old is not None:
            self.bytes -= old.size
        self._records[stored.id] = stored
        self.bytes += stored.size
        while self._records and (len(self._records) > self._records.capacity or self.bytes > self._max_bytes):
            self._forget(next(iter(self._records)), "evicted")

    def drop(self, response_id: str) -> bool:
        return self._forget(response_id, None)

    def _forget(self, response_id: str, why: str | None) -> bool:
        stored = self._records.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        if why is not None:
            self._metrics.events.labels(why).inc()
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.find(response_id)

    async def put(self, stored: StoredResponse) -> None:
        self.keep(stored)

    async def delete(self, response_id: str) -> bool:
        return self.drop(response_id)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class RedisResponses:
    """The responses of every worker and replica, in Redis: one key each, expiring after ``ttl_s``."""

    def __init__(self, config: ResponsesConfig, redis_url: str, timeout_s: float) -> None:
        self._prefix = config.redis_key_prefix
        self._ttl_ms = max(1, int(config.ttl_s * 1000))
        self._url = redis_url
        self._timeout_s = timeout_s
        self._client = None

    async def start(self) -> None:
        import redis.asyncio as redis  # imported only with shared_state.redis_url set

        self._client = redis.from_url(self._url, socket_timeout=self._timeout_s,
                                      socket_connect_timeout=self._timeout_s)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def get(self, response_id: str) -> StoredResponse | None:
        data = await self._call("get", self._prefix + response_id)
        return decode(data) if data else None

    async def put(self, stored: StoredResponse) -> None:
        await self._call("set", self._prefix + stored.id, encode(stored), px=self._ttl_ms)

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call("delete", self._prefix + response_id))

    async def _call(self, op: str, *args: object, **kwargs: object) -> object:
        assert self._client is not None, "the store is used before it started"
        try:
            return await getattr(self._client, op)(*args, **kwargs)
        except Exception as exc:  # redis.RedisError, OSError, the socket timeout
            log.warning("the Responses store in Redis failed (%s): %s", op, exc)
            raise StoreUnavailable(str(exc)) from None
