"""Forwarding and relaying: one attempt of a request on the pod the router chose, its answer relayed
byte for byte.

Owner: the proxy writes the relay's fields of the request context (status on a broken stream, time of
the first byte, usage, streamed events) and reports upstream outcomes to the registry (passive
ejection). One shared ``aiohttp.ClientSession`` (the :class:`~gateway.http_client.HttpClient`) carries
all upstream traffic. The client's body is sent upstream as received, and the pod's bytes (SSE chunks
included) reach the client unchanged: nothing on this path re-encodes JSON. Everything else a request
goes through is a step of the pipeline (:mod:`gateway.request.pipeline`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.api.errors import ApiError, upstream_failed, upstream_timeout
from gateway.api.usage import usage_of_body, usage_of_stream_tail
from gateway.backends.registry import Pod, PodRegistry
from gateway.config import AuthConfig, ServerConfig, TimeoutConfig
from gateway.http_client import HttpClient
from gateway.metrics import GatewayMetrics
from gateway.routing.policy import Decision

if TYPE_CHECKING:
    from gateway.request.context import RequestContext

log = logging.getLogger("gateway.proxy")

# Never forwarded: hop-by-hop headers, and those aiohttp sets itself for the new connection.
_SKIP_REQUEST_HEADERS = frozenset(
    h.lower() for h in (
        "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
        "upgrade", "proxy-authorization", "proxy-connection", "authorization", "expect",
    )
)
_RELAYED_RESPONSE_HEADERS = ("content-type", "content-encoding", "cache-control")
_UPSTREAM_ERROR_SNIPPET = 512
_UNTIMED_CHUNK = 16 * 1024  # smaller writes cannot block on a client with an empty backlog


class ClientStalled(Exception):
    """The client stopped reading a stream for longer than ``server.client_stall_s``."""


class RetryableFailure(Exception):
    """The pod failed before anything reached the client: another pod may take the request."""

    def __init__(self, error: ApiError, cause: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.cause = cause


class Proxy:
    def __init__(self, pods: PodRegistry, metrics: GatewayMetrics, http: HttpClient, timeouts: TimeoutConfig,
                 auth: AuthConfig, server: ServerConfig) -> None:
        self._pods = pods
        self._metrics = metrics
        self._http = http
        self._auth = auth
        self._client_stall_s = server.client_stall_s
        self._first_byte_s = timeouts.first_byte_s
        self._idle_s = timeouts.idle_s
        # aiohttp's per-read timeout covers both the wait for headers and the gaps between chunks; an
        # extra timer per request is paid only for whichever of the two is configured shorter.
        sock_read = max(timeouts.first_byte_s, timeouts.idle_s)
        self._explicit_first_byte = timeouts.first_byte_s < sock_read
        self._explicit_idle = timeouts.idle_s < sock_read
        self._client_timeout = aiohttp.ClientTimeout(
            total=timeouts.total_s, sock_connect=timeouts.connect_s, sock_read=sock_read
        )

    async def forward(self, ctx: RequestContext) -> web.StreamResponse:
        """Send the request to the decided pod and relay its answer; a failure before anything reached
        the client raises :class:`RetryableFailure` (the director may try another pod)."""
        decision = ctx.decision
        assert decision is not None
        pod = decision.pod
        try:
            upstream = await self._send(pod, ctx.http.path_qs, ctx.body, ctx.upstream_headers)
            try:
                if upstream.status >= 500:
                    raise await self._upstream_5xx(pod, upstream)
                self._pods.report_success(pod)
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    return await self._relay_stream(ctx, decision, upstream)
                return await self._relay_body(ctx, decision, upstream)
            finally:
                # On client disconnect (handler cancelled) this drops the connection: the pod sees it.
                upstream.close()
        except RetryableFailure as exc:
            self._metrics.retries.labels(pod.name, exc.cause).inc()
            raise

    def upstream_headers(self, incoming: CIMultiDictProxy[str], request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in incoming.items() if k.lower() not in _SKIP_REQUEST_HEADERS}
        headers["x-request-id"] = request_id
        if self._auth.upstream == "pass":
            if "authorization" in incoming:
                headers["authorization"] = incoming["authorization"]
        elif self._auth.upstream == "replace":
            headers["authorization"] = f"Bearer {self._auth.upstream_api_key}"
        return headers

    async def _send(
        self, pod: Pod, path: str, body: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        try:
            sending = self._http.session.post(pod.url + path, data=body, headers=headers, timeout=self._client_timeout)
            if not self._explicit_first_byte:
                return await sending
            async with asyncio.timeout(self._first_byte_s):
                return await sending
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self._pods.report_connect_failure(pod, str(exc))
            self._metrics.upstream_errors.labels(pod.name, "connect").inc()
            raise RetryableFailure(upstream_failed(f"Pod {pod.name} is unreachable: {exc}"), "connect") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            self._metrics.upstream_errors.labels(pod.name, "disconnect").inc()
            raise RetryableFailure(
                upstream_failed(f"Pod {pod.name} closed the connection before answering: {exc}"),
                "disconnect",
            ) from None
        except TimeoutError:
            # Not retried: the pod may still be working on it, and a second copy would double the load.
            self._metrics.upstream_errors.labels(pod.name, "first_byte_timeout").inc()
            raise upstream_timeout(
                f"Pod {pod.name} sent nothing within {self._first_byte_s:g} s."
            ) from None

    async def _upstream_5xx(self, pod: Pod, upstream: aiohttp.ClientResponse) -> RetryableFailure:
        try:
            snippet = (await upstream.content.read(_UPSTREAM_ERROR_SNIPPET)).decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            snippet = ""
        self._metrics.upstream_errors.labels(pod.name, f"status_{upstream.status}").inc()
        detail = f": {snippet.strip()}" if snippet.strip() else ""
        message = f"Pod {pod.name} answered HTTP {upstream.status}{detail}"
        self._pods.report_server_error(pod, message)
        return RetryableFailure(upstream_failed(message), "status_5xx")

    @staticmethod
    def _response_headers(ctx: RequestContext, decision: Decision, upstream: aiohttp.ClientResponse) -> dict:
        headers = {h: upstream.headers[h] for h in _RELAYED_RESPONSE_HEADERS if h in upstream.headers}
        headers["x-request-id"] = ctx.request_id
        headers["x-gateway-pod"] = decision.pod.name
        headers["x-gateway-policy"] = decision.policy
        headers["x-gateway-prefix-tokens"] = str(decision.prefix_tokens)
        headers["x-gateway-cache-action"] = ctx.workflow.header
        return headers

    async def _relay_body(
        self, ctx: RequestContext, decision: Decision, upstream: aiohttp.ClientResponse
    ) -> web.Response:
        pod = decision.pod
        try:
            data = await upstream.read()
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            self._metrics.upstream_errors.labels(pod.name, "body").inc()
            raise RetryableFailure(
                upstream_failed(f"Pod {pod.name} failed while sending its answer: {exc}"), "body"
            ) from None
        except TimeoutError:
            self._metrics.upstream_errors.labels(pod.name, "idle_timeout").inc()
            raise upstream_timeout(f"Pod {pod.name} stalled while sending its answer.") from None
        ctx.first_byte_at = time.monotonic()
        if upstream.status == 200:
            ctx.usage = usage_of_body(data)
        elif upstream.status >= 400 and not upstream.headers.get("content-type", "").startswith("application/json"):
            # An engine's own errors are OpenAI JSON and pass as they are; anything else gets that shape.
            text = data[:_UPSTREAM_ERROR_SNIPPET].decode(errors="replace").strip()
            raise ApiError(upstream.status, f"Pod {pod.name} answered HTTP {upstream.status}: {text}",
                           type="upstream_error", code=f"upstream_{upstream.status}")
        return web.Response(status=upstream.status, body=data,
                            headers=self._response_headers(ctx, decision, upstream))

    async def _relay_stream(
        self, ctx: RequestContext, decision: Decision, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        pod = decision.pod
        request = ctx.http
        response = web.StreamResponse(status=upstream.status,
                                      headers=self._response_headers(ctx, decision, upstream))
        await response.prepare(request)
        last_chunks: deque[bytes] = deque(maxlen=4)
        try:
            transport = request.transport
            async for chunk in self._chunks(upstream):
                if ctx.first_byte_at is None:
                    ctx.first_byte_at = time.monotonic()
                if transport is not None and (len(chunk) > _UNTIMED_CHUNK or transport.get_write_buffer_size()):
                    # A backlog (or a chunk that could fill the socket): the client may read slower than
                    # the pod writes. Wait for it, but not forever.
                    await self._write_or_stall(response, chunk)
                else:
                    await response.write(chunk)
                last_chunks.append(chunk)
                ctx.streamed_events += chunk.count(b"data: ")
        except ClientStalled:
            self._metrics.stream_aborts.labels(pod.name, "client_stalled").inc()
            log.warning("request %s: client stalled for %g s; stream cut", ctx.request_id,
                        self._client_stall_s)
            if request.transport is not None:
                request.transport.abort()
            ctx.status = 499
            return response
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                TimeoutError) as exc:
            kind = "idle_timeout" if isinstance(exc, TimeoutError) else "mid_stream"
            self._metrics.stream_aborts.labels(pod.name, "upstream").inc()
            self._metrics.upstream_errors.labels(pod.name, kind).inc()
            log.warning("request %s: pod %s broke the stream (%s)", ctx.request_id, pod.name, kind)
            error = upstream_failed(f"Pod {pod.name} stopped the stream early ({kind}).")
            if ctx.kind == "messages":  # Anthropic's streams name each event
                await response.write(b"event: error\ndata: " + error.body(anthropic=True) + b"\n\n")
            else:
                await response.write(b"data: " + error.body() + b"\n\n")
            ctx.status = 502
            return response
        except ConnectionResetError:
            self._metrics.stream_aborts.labels(pod.name, "client").inc()
            ctx.status = 499
            return response
        ctx.usage = usage_of_stream_tail(last_chunks)
        await response.write_eof()
        return response

    async def _write_or_stall(self, response: web.StreamResponse, chunk: bytes) -> None:
        try:
            async with asyncio.timeout(self._client_stall_s):
                await response.write(chunk)
        except TimeoutError:
            raise ClientStalled from None

    async def _chunks(self, upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        if not self._explicit_idle:
            async for chunk in upstream.content.iter_any():
                yield chunk
            return
        while True:
            async with asyncio.timeout(self._idle_s):
                chunk = await upstream.content.readany()
            if not chunk:
                return
            yield chunk
