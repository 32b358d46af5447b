"""Relaying a pod's answer to the client: a whole body, or an SSE stream chunk by chunk, unchanged.

Each relay returns the answer's :class:`~gateway.proxy.outcome.RelayOutcome`. A body that fails to
arrive raises (nothing reached the client yet); a stream that breaks after its headers went out ends with
an error event in the route's shape, and its outcome says so.

A client reading a long stream slowly is not timed while the kernel takes the bytes: its socket's send
buffer (``net.ipv4.tcp_wmem``, up to a few MB) absorbs them at no cost to the gateway's own memory, and
the pod is not held back. Only once that buffer is full does the gateway's write buffer grow; from then
on, a client that reads nothing for ``server.client_stall_s`` is cut (``gateway_stream_aborts_total
{side="client_stalled"}``), so one slow reader holds at most one socket buffer, never the gateway's heap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from gateway.config import TimeoutConfig
from gateway.core.errors import upstream_failed, upstream_timeout
from gateway.core.usage import usage_of_body, usage_of_stream_tail
from gateway.http_errors import error_event
from gateway.metrics import GatewayMetrics
from gateway.proxy.events import EventCheck
from gateway.proxy.outcome import Ending, RelayOutcome, RetryableFailure, UpstreamCall
from gateway.proxy.pod_errors import translated

log = logging.getLogger("gateway.proxy")

RELAYED_RESPONSE_HEADERS = ("content-type", "content-encoding", "cache-control")
ERROR_SNIPPET = 512
_UNTIMED_CHUNK = 16 * 1024  # smaller writes cannot block on a client with an empty backlog
_UPSTREAM_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class ClientStalled(Exception):
    """The client stopped reading a stream for longer than ``server.client_stall_s``."""


class Relay:
    def __init__(self, metrics: GatewayMetrics, timeouts: TimeoutConfig, client_stall_s: float,
                 explicit_idle: bool, explicit_first_byte: bool) -> None:
        self._metrics = metrics
        self._idle_s = timeouts.idle_s
        self._first_byte_s = timeouts.first_byte_s
        self._client_stall_s = client_stall_s
        # aiohttp's own read timeout (the longer of the two) covers a stream's first chunk unless ``first_byte_s``
        # is the shorter one, and the gaps between chunks unless ``idle_s`` is.
        self._explicit_idle = explicit_idle
        self._explicit_first_byte = explicit_first_byte

    @staticmethod
    def answer_headers(call: UpstreamCall, upstream: aiohttp.ClientResponse) -> dict[str, str]:
        headers = {h: upstream.headers[h] for h in RELAYED_RESPONSE_HEADERS if h in upstream.headers}
        headers.update(call.answer_headers)
        return headers

    async def read(self, pod: str, upstream: aiohttp.ClientResponse) -> bytes:
        """The whole body of an answer; one that fails to arrive raises (nothing reached the client)."""
        try:
            return await upstream.read()
        except _UPSTREAM_READ_ERRORS as exc:
            self._metrics.upstream_errors.labels(pod, "body").inc()
            failed = upstream_failed(f"Pod {pod} failed while sending its answer: {exc}")
            raise RetryableFailure(failed, "body") from None
        except TimeoutError:
            self._metrics.upstream_errors.labels(pod, "idle_timeout").inc()
            raise upstream_timeout(f"Pod {pod} stalled while sending its answer.") from None

    async def body(self, call: UpstreamCall, upstream: aiohttp.ClientResponse, headers_at: float | None = None
                   ) -> tuple[web.Response, RelayOutcome]:
        pod = call.pod.name
        data = await self.read(pod, upstream)
        first_byte_at = time.monotonic()
        if call.answering is not None:
            call.answering()
        if upstream.status >= 400:  # the pod's own error, in the route's shape, its status and text kept
            error = translated(upstream.status, data, call.path)
            response = error.to_response(call.anthropic)
            response.headers.update(call.answer_headers)
            return response, RelayOutcome(error.status, Ending.COMPLETE, first_byte_at, headers_at=headers_at)
        usage = usage_of_body(data) if upstream.status == 200 else None
        if call.rewrite is not None and upstream.status == 200:
            data = call.rewrite.body(data)
        if call.tap is not None and upstream.status == 200 and (keeping := call.tap.whole(pod, data)) is not None:
            await keeping
        response = web.Response(status=upstream.status, body=data, headers=self.answer_headers(call, upstream))
        return response, RelayOutcome(upstream.status, Ending.COMPLETE, first_byte_at, usage, headers_at=headers_at,
                                      response_id=call.rewrite.response_id if call.rewrite is not None else None)

    async def stream(self, call: UpstreamCall, client: web.Request, upstream: aiohttp.ClientResponse,
                     headers_at: float | None = None) -> tuple[web.StreamResponse, RelayOutcome]:
        pod = call.pod.name
        response = web.StreamResponse(status=upstream.status, headers=self.answer_headers(call, upstream))
        await response.prepare(client)
        sent = _StreamSent(call, client, response, headers_at)
        check = EventCheck()
        try:
            await self._relay_chunks(call, upstream, sent, check)
            if check.malformed:
                return response, await self._malformed(call, response, sent.ended)
        except ClientStalled:
            return response, self._client_stalled(call, client, sent)
        except (*_UPSTREAM_READ_ERRORS, TimeoutError) as exc:
            return response, await self._upstream_broke(call, sent, exc)
        except ConnectionResetError:
            self._metrics.stream_aborts.labels(pod, "client").inc()
            return response, sent.ended(499, Ending.CLIENT_GONE)
        except asyncio.CancelledError:  # the client left while the relay waited for the pod
            self._metrics.stream_aborts.labels(pod, "client").inc()
            if call.left is not None:
                call.left(sent.ended(499, Ending.CLIENT_GONE))
            raise
        await response.write_eof()
        if check.engine_error:
            log.warning("request %s: pod %s wrote an error event into its stream", call.request_id, pod)
            return response, sent.ended(502, Ending.ENGINE_ERROR)
        return response, sent.ended(upstream.status, Ending.COMPLETE)

    async def _relay_chunks(self, call: UpstreamCall, upstream: aiohttp.ClientResponse, sent: _StreamSent,
                            check: EventCheck) -> None:
        """The pod's chunks passed on as they come, up to the stream's end or its first malformed event."""
        async for chunk in self._chunks(upstream):
            if sent.first_byte_at is None:
                sent.first_byte_at = time.monotonic()
                if call.answering is not None:
                    call.answering()
            if chunk := check.chunk(chunk):
                await self._pass_on(sent, chunk)
            if check.malformed:
                break
        else:
            if rest := check.rest():
                await self._pass_on(sent, rest)
        if sent.rewrite is not None and (rest := sent.rewrite.rest()):
            await sent.response.write(rest)  # a last event without its blank line
            sent.last_chunks.append(rest)

    async def _pass_on(self, sent: _StreamSent, chunk: bytes) -> None:
        """One checked chunk to the client: rewritten, tapped, and written (timed when the client lags)."""
        rewrite, tap, transport = sent.rewrite, sent.tap, sent.transport
        if rewrite is not None and not (chunk := rewrite.chunk(chunk)):
            return  # an event cut in two: the rest comes with the next chunk
        if tap is not None and (reading := tap.chunk(sent.pod, chunk)) is not None:
            await reading
        if transport is not None and (len(chunk) > _UNTIMED_CHUNK or transport.get_write_buffer_size()):
            # A backlog (or a chunk that could fill the socket): the client may read slower than
            # the pod writes. Wait for it, but not forever.
            await self._write_or_stall(sent.response, chunk)
        else:
            await sent.response.write(chunk)
        sent.last_chunks.append(chunk)
        sent.events += chunk.count(b"data: ")

    def _client_stalled(self, call: UpstreamCall, client: web.Request, sent: _StreamSent) -> RelayOutcome:
        """The client read nothing for ``client_stall_s``: its connection is cut."""
        self._metrics.stream_aborts.labels(sent.pod, "client_stalled").inc()
        log.warning("request %s: client stalled for %g s; stream cut", call.request_id, self._client_stall_s)
        if client.transport is not None:
            client.transport.abort()
        return sent.ended(499, Ending.CLIENT_STALLED)

    async def _upstream_broke(self, call: UpstreamCall, sent: _StreamSent, exc: BaseException) -> RelayOutcome:
        """The pod broke off or went quiet mid-stream: the stream ends with an error event in the route's shape."""
        pod = sent.pod
        if isinstance(exc, TimeoutError):
            kind = "idle_timeout" if sent.first_byte_at is not None else "first_byte_timeout"
        else:
            kind = "mid_stream"
        self._metrics.stream_aborts.labels(pod, "upstream").inc()
        self._metrics.upstream_errors.labels(pod, kind).inc()
        log.warning("request %s: pod %s broke the stream (%s)", call.request_id, pod, kind)
        error = upstream_failed(f"Pod {pod} stopped the stream early ({kind}).")
        try:
            await sent.response.write(error_event(error, call.anthropic))
        except ConnectionResetError:
            return sent.ended(499, Ending.CLIENT_GONE)
        return sent.ended(502, Ending.UPSTREAM_BROKE)

    async def _malformed(self, call: UpstreamCall, response: web.StreamResponse,
                         ended: Callable[[int, Ending], RelayOutcome]) -> RelayOutcome:
        """A pod's event that is not JSON: held back, and the stream ends with an error event in the route's
        shape instead (an SDK would raise a JSON decode error on it)."""
        log.warning("request %s: pod %s wrote an event that is not JSON; stream ended", call.request_id,
                    call.pod.name)
        error = upstream_failed(f"Pod {call.pod.name} sent a malformed event; the stream was ended.")
        try:
            await response.write(error_event(error, call.anthropic))
            await response.write_eof()
        except ConnectionResetError:
            return ended(499, Ending.CLIENT_GONE)
        return ended(502, Ending.MALFORMED)

    async def _write_or_stall(self, response: web.StreamResponse, chunk: bytes) -> None:
        try:
            async with asyncio.timeout(self._client_stall_s):
                await response.write(chunk)
        except TimeoutError:
            raise ClientStalled from None

    async def _chunks(self, upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The stream's chunks. An engine sends a stream's headers at once and its first chunk once the prompt
        is prefilled: that chunk is the answer's first byte, and waits up to ``first_byte_s``; each later one
        up to ``idle_s``."""
        content = upstream.content
        limit_s = self._first_byte_s if self._explicit_first_byte else None
        while chunk := await _read(content, limit_s):
            yield chunk
            limit_s = self._idle_s if self._explicit_idle else None


class _StreamSent:
    """What one stream relay has passed on so far, for its outcome. Producer: :meth:`Relay.stream`."""

    __slots__ = ("events", "first_byte_at", "headers_at", "last_chunks", "pod", "response", "rewrite", "tap",
                 "transport")

    def __init__(self, call: UpstreamCall, client: web.Request, response: web.StreamResponse,
                 headers_at: float | None) -> None:
        self.pod = call.pod.name
        self.response = response
        self.rewrite = call.rewrite
        self.tap = call.tap
        self.transport = client.transport
        self.headers_at = headers_at
        self.last_chunks: deque[bytes] = deque(maxlen=4)
        self.first_byte_at: float | None = None
        self.events = 0

    def ended(self, status: int, ending: Ending) -> RelayOutcome:
        usage = usage_of_stream_tail(self.last_chunks) if ending is Ending.COMPLETE else None
        rewrite = self.rewrite
        return RelayOutcome(status, ending, self.first_byte_at, usage, self.events, self.headers_at,
                            rewrite.response_id if rewrite is not None else None, sent=self.response.status)


async def _read(content: aiohttp.StreamReader, limit_s: float | None) -> bytes:
    """The next chunk; within ``limit_s`` when aiohttp's own read timeout does not already bound it (None)."""
    if limit_s is None:
        return await content.readany()
    async with asyncio.timeout(limit_s):
        return await content.readany()

