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

Owner: each store owns its records; the Responses step (:mod:`gateway.request.responses_state`) writes them as
answers arrive, the Responses routes read and delete them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter

from gateway.config import ResponsesConfig

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

    async def put(self, stored: StoredResponse) -> bool:
        """Whether it was kept (False: an id already held, never replaced; or too large)."""
        ...

    async def delete(self, stored: StoredResponse) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ResponsesMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "gateway_responses", "The Responses API's stored responses: stored, found, not_found, deleted, "
            "expired, evicted, duplicate, store_failed", ["event"], registry=registry)


@dataclass(slots=True)
class _Holding:
    """One owner's responses in memory: their ids, least recently used first, and their bytes."""

    ids: dict[str, None] = field(default_factory=dict)
    bytes: int = 0


class MemoryResponses:
    """This process's responses, each for ``ttl_s``: at most ``max_responses_per_key`` of one API key (its
    least recently used go first) and ``max_responses`` and ``max_bytes`` in all, past which the owner
    holding the most (by count, by bytes) loses its least recently used: one key's flood never evicts the few
    of another. With keys off every response is one owner's ("") and only the totals apply."""

    def __init__(self, config: ResponsesConfig, metrics: ResponsesMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self._max_bytes = config.max_bytes
        self._max_responses = config.max_responses
        self._per_key = config.max_responses_per_key
        self._ttl_s = config.ttl_s
        self._clock = clock
        self._metrics = metrics
        self._records: dict[str, StoredResponse] = {}
        self._owners: dict[str, _Holding] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def held_by(self, owner: str) -> int:
        holding = self._owners.get(owner)
        return len(holding.ids) if holding is not None else 0

    def find(self, response_id: str) -> StoredResponse | None:
        stored = self._records.get(response_id)
        if stored is None:
            return None
        if self._clock() - stored.created > self._ttl_s:
            self._forget(response_id, "expired")
            return None
        ids = self._owners[stored.owner].ids
        del ids[response_id]
        ids[response_id] = None  # the most recently used
        return stored

    def keep(self, stored: StoredResponse) -> bool:
        """Whether it was kept: never past the byte bound alone, and never over a response of the same id
        (ids are the gateway's own and unique: one already held is no one else's to replace)."""
        if stored.size > self._max_bytes:  # it would evict every other response, then itself
            log.warning("response %s (%d bytes) exceeds responses.max_bytes; not kept", stored.id, stored.size)
            self._metrics.events.labels("evicted").inc()
            return False
        if stored.id in self._records:
            self._metrics.events.labels("duplicate").inc()
            return False
        self._records[stored.id] = stored
        holding = self._owners.setdefault(stored.owner, _Holding())
        holding.ids[stored.id] = None
        holding.bytes += stored.size
        self.bytes += stored.size
        if stored.owner and len(holding.ids) > self._per_key:
            self._forget(next(iter(holding.ids)), "evicted")
        while len(self._records) > self._max_responses:
            self._forget(next(iter(max(self._owners.values(), key=lambda h: len(h.ids)).ids)), "evicted")
        while self.bytes > self._max_bytes:
            self._forget(next(iter(max(self._owners.values(), key=lambda h: h.bytes).ids)), "evicted")
        return True

    def drop(self, response_id: str) -> bool:
        return self._forget(response_id, None)

    def _forget(self, response_id: str, why: str | None) -> bool:
        stored = self._records.pop(response_id, None)
        if stored is None:
            return False
        holding = self._owners[stored.owner]
        del holding.ids[response_id]
        holding.bytes -= stored.size
        if not holding.ids:
            del self._owners[stored.owner]
        self.bytes -= stored.size
        if why is not None:
            self._metrics.events.labels(why).inc()
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.find(response_id)

    async def put(self, stored: StoredResponse) -> bool:
        return self.keep(stored)

    async def delete(self, stored: StoredResponse) -> bool:
        return self.drop(stored.id)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


# Keeps a response unless its id is held, then the per-key and total bounds (as the memory store's, by count,
# oldest stored first), in one step: every worker and replica sees the bounds kept. ``<prefix><id>`` is the
# record (expiring after the ttl); ``<prefix>~all`` every response ("<owner>\n<id>" by when stored),
# ``<prefix>~owner:<owner>`` each owner's (<id> by when stored), ``<prefix>~owners`` each owner's count.
# Returns -1 (the id is held), else how many it evicted; entries whose record expired are swept on the way.
_PUT = r"""
local prefix, owner, id, data = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now, ttl, per_key, total = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local all, owners = prefix .. '~all', prefix .. '~owners'
local function forget(who, rid)
  redis.call('ZREM', all, who .. '\n' .. rid)
  if redis.call('ZREM', prefix .. '~owner:' .. who, rid) == 1 then
    if tonumber(redis.call('ZINCRBY', owners, -1, who)) <= 0 then redis.call('ZREM', owners, who) end
  end
  return redis.call('DEL', prefix .. rid)
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', all, '-inf', now - ttl, 'LIMIT', 0, 100)) do
  local who, rid = string.match(member, '^(.-)\n(.*)$')
  forget(who, rid)
end
if redis.call('EXISTS', prefix .. id) == 1 then return -1 end
redis.call('SET', prefix .. id, data, 'PX', ttl)
redis.call('ZADD', all, now, owner .. '\n' .. id)
redis.call('ZADD', prefix .. '~owner:' .. owner, now, id)
redis.call('ZINCRBY', owners, 1, owner)
local evicted = 0
local mine = prefix .. '~owner:' .. owner
while owner ~= '' and redis.call('ZCARD', mine) > per_key do
  forget(owner, redis.call('ZRANGE', mine, 0, 0)[1])
  evicted = evicted + 1
end
while redis.call('ZCARD', all) > total do
  local biggest = redis.call('ZREVRANGE', owners, 0, 0)[1]
  forget(biggest, redis.call('ZRANGE', prefix .. '~owner:' .. biggest, 0, 0)[1])
  evicted = evicted + 1
end
return evicted
"""
_DELETE = r"""
local prefix, owner, id = ARGV[1], ARGV[2], ARGV[3]
redis.call('ZREM', prefix .. '~all', owner .. '\n' .. id)
if redis.call('ZREM', prefix .. '~owner:' .. owner, id) == 1 then
  if tonumber(redis.call('ZINCRBY', prefix .. '~owners', -1, owner)) <= 0 then
    redis.call('ZREM', prefix .. '~owners', owner)
  end
end
return redis.call('DEL', prefix .. id)
"""


class RedisResponses:
    """The responses of every worker and replica, in Redis: one key each, expiring after ``ttl_s``, at most
    ``max_responses_per_key`` of one API key and ``max_responses`` in all (the owner holding the most loses
    its oldest), kept by one script per response. The scripts name keys they build (one Redis, not a
    cluster)."""

    def __init__(self, config: ResponsesConfig, redis_url: str, timeout_s: float, metrics: ResponsesMetrics) -> None:
        self._prefix = config.redis_key_prefix
        self._ttl_ms = max(1, int(config.ttl_s * 1000))
        self._bounds = (config.max_responses_per_key, config.max_responses)
        self._url = redis_url
        self._timeout_s = timeout_s
        self._metrics = metrics
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

    async def put(self, stored: StoredResponse) -> bool:
        per_key, total = self._bounds
        evicted = await self._call("eval", _PUT, 0, self._prefix, stored.owner, stored.id, encode(stored),
                                   int(time.time() * 1000), self._ttl_ms, per_key, total)
        if evicted == -1:
            self._metrics.events.labels("duplicate").inc()
            return False
        if evicted:
            self._metrics.events.labels("evicted").inc(evicted)
        return True

    async def delete(self, stored: StoredResponse) -> bool:
        return bool(await self._call("eval", _DELETE, 0, self._prefix, stored.owner, stored.id))

    async def _call(self, op: str, *args: object, **kwargs: object) -> object:
        assert self._client is not None, "the store is used before it started"
        try:
            return await getattr(self._client, op)(*args, **kwargs)
        except Exception as exc:  # redis.RedisError, OSError, the socket timeout
            log.warning("the Responses store in Redis failed (%s): %s", op, exc)
            raise StoreUnavailable(str(exc)) from None
