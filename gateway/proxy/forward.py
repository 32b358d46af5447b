"""Forwarding: one attempt of a request sent to the pod the router chose, its answer relayed.

Owner: the proxy reports upstream outcomes to the pod registry (passive ejection) and owns nothing
else. One shared ``aiohttp.ClientSession`` (the :class:`~gateway.http_client.HttpClient`) carries all
upstream traffic. The client's body goes upstream as received and the pod's bytes (SSE chunks included)
reach the client unchanged: nothing on this path re-encodes JSON (the one body the gateway writes itself is a
disaggregated request's, :mod:`gateway.request.disaggregation`). What happened comes back as a
:class:`~gateway.proxy.outcome.RelayOutcome`; everything else a request goes through is a step of the
pipeline (:mod:`gateway.request.pipeline`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web

from gateway.background import own_stall
from gateway.config import AuthConfig, ServerConfig, TimeoutConfig
from gateway.core.errors import upstream_failed, upstream_timeout
from gateway.http_client import HttpClient
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import Pod, PodRegistry
from gateway.proxy.outcome import Ending, RelayOutcome, RetryableFailure, UpstreamCall
from gateway.proxy.relay import ERROR_SNIPPET, Relay

log = logging.getLogger("gateway.proxy")

# Never forwarded: hop-by-hop headers, those aiohttp sets itself for the new connection, and the body's
# type (what the gateway sends is JSON, whatever JSON type its client declared: the director says so).
_SKIP_REQUEST_HEADERS = frozenset(
    h.lower() for h in (
        "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
        "upgrade", "proxy-authorization", "proxy-connection", "authorization", "x-api-key", "expect",
        "content-encoding", "content-type",
    )
)
# Streams the engine failed inside, by the kind of upstream error they count as.
_ENGINE_FAILURES = {Ending.ENGINE_ERROR: "engine_error", Ending.MALFORMED: "malformed_event"}
# The client's key, however its SDK sent it: passed to the pod only with ``auth.upstream: pass``.
_KEY_HEADERS = ("authorization", "x-api-key")


class Proxy:
    def __init__(self, pods: PodRegistry, metrics: GatewayMetrics, http: HttpClient, timeouts: TimeoutConfig,
                 auth: AuthConfig, server: ServerConfig, loop_stalled: Callable[[float], float]) -> None:
        self._pods = pods
        self._loop_stalled = loop_stalled
        self._connect_s = timeouts.connect_s
        self._metrics = metrics
        self._http = http
        self._auth = auth
        self._first_byte_s = timeouts.first_byte_s
        # aiohttp's per-read timeout covers both the wait for the first byte (the headers, and a stream's first
        # chunk) and the gaps between chunks; an extra timer per request is paid only for whichever of the two
        # is configured shorter.
        sock_read = max(timeouts.first_byte_s, timeouts.idle_s)
        self._explicit_first_byte = timeouts.first_byte_s < sock_read
        self._client_timeout = aiohttp.ClientTimeout(
            total=timeouts.total_s, sock_connect=timeouts.connect_s, sock_read=sock_read
        )
        self._relay = Relay(metrics, timeouts, server.client_stall_s, explicit_idle=timeouts.idle_s < sock_read,
                            explicit_first_byte=self._explicit_first_byte)

    async def forward(self, call: UpstreamCall, client: web.Request) -> tuple[web.StreamResponse, RelayOutcome]:
        """Send the request to ``call.pod`` and relay its answer to ``client``; a failure before anything
        reached the client raises :class:`RetryableFailure` (the director may try another pod)."""
        pod = call.pod
        try:
            upstream = await self._send(pod, call.path, call.body, call.headers)
            headers_at = time.monotonic()
            try:
                if upstream.status >= 500:
                    raise await self._upstream_5xx(pod, upstream)
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    response, outcome = await self._relay.stream(call, client, upstream, headers_at)
                    self._judge_stream(pod, outcome)
                    return response, outcome
                self._pods.report_success(pod)
                return await self._relay.body(call, upstream, headers_at)
            finally:
                # On client disconnect (handler cancelled) this drops the connection: the pod sees it.
                upstream.close()
        except RetryableFailure as exc:
            self._metrics.retries.labels(pod.name, exc.cause).inc()
            raise

    async def exchange(self, pod: Pod, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """A whole answer kept by the gateway, not relayed (a prefill leg): its status and body. Failures are
        those of :meth:`forward`: :class:`RetryableFailure` when another pod may take it."""
        try:
            upstream = await self._send(pod, path, body, headers)
            try:
                if upstream.status >= 500:
                    raise await self._upstream_5xx(pod, upstream)
                self._pods.report_success(pod)
                return upstream.status, await self._relay.read(pod.name, upstream)
            finally:
                upstream.close()
        except RetryableFailure as exc:
            self._metrics.retries.labels(pod.name, exc.cause).inc()
            raise

    def upstream_headers(self, incoming: Mapping[str, str], request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in incoming.items() if k.lower() not in _SKIP_REQUEST_HEADERS}
        headers["x-request-id"] = request_id
        if self._auth.upstream == "pass":
            headers.update((h, incoming[h]) for h in _KEY_HEADERS if h in incoming)
        elif self._auth.upstream == "replace":
            headers["authorization"] = f"Bearer {self._auth.upstream_api_key}"
        return headers

    async def _send(self, pod: Pod, path: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        try:
            started = time.perf_counter()
            try:
                return await self._post(pod, path, body, headers)
            except aiohttp.ConnectionTimeoutError:
                if (stalled := own_stall(self._loop_stalled, started, self._connect_s)) is None:
                    raise
                # The connect's timer ran out while the gateway's own event loop stood still (a burst of CPU
                # work, the machine paused): its answer, there by then, waited behind the timer. Once more.
                log.warning("connect to pod %s timed out while the event loop stood still for %.1f s; sent again",
                            pod.name, stalled)
                self._metrics.stalled_connects.labels(pod.name).inc()
                return await self._post(pod, path, body, headers)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self._pods.report_connect_failure(pod, str(exc))
            self._metrics.upstream_errors.labels(pod.name, "connect").inc()
            raise RetryableFailure(upstream_failed(f"Pod {pod.name} is unreachable: {exc}"), "connect") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            self._metrics.upstream_errors.labels(pod.name, "disconnect").inc()
            raise RetryableFailure(
                upstream_failed(f"Pod {pod.name} closed the connection before answering: {exc}"), "disconnect",
            ) from None
        except aiohttp.ClientResponseError as exc:  # what came back is not HTTP (a bad status line or header)
            message = f"Pod {pod.name} answered with invalid HTTP: {' '.join(exc.message.split())}"
            self._metrics.upstream_errors.labels(pod.name, "invalid_response").inc()
            self._pods.report_server_error(pod, message)
            raise RetryableFailure(upstream_failed(message), "invalid_response") from None
        except TimeoutError:
            # Not retried: the pod may still be working on it, and a second copy would double the load.
            self._metrics.upstream_errors.labels(pod.name, "first_byte_timeout").inc()
            raise upstream_timeout(f"Pod {pod.name} sent nothing within {self._first_byte_s:g} s.") from None

    async def _post(self, pod: Pod, path: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        sending = self._http.session.post(pod.url + path, data=body, headers=headers, timeout=self._client_timeout)
        if not self._explicit_first_byte:
            return await sending
        async with asyncio.timeout(self._first_byte_s):
            return await sending

    def _judge_stream(self, pod: Pod, outcome: RelayOutcome) -> None:
        """A stream is the pod's success once it ended well; one the engine failed inside (its own error event,
        or one that is not JSON) counts against the pod as a 5xx answer does: its 200 headers said nothing of
        how the answer would go."""
        kind = _ENGINE_FAILURES.get(outcome.ending)
        if kind is None:
            if outcome.ending is Ending.COMPLETE:
                self._pods.report_success(pod)
            return
        self._metrics.upstream_errors.labels(pod.name, kind).inc()
        self._pods.report_server_error(pod, f"Pod {pod.name} failed inside a stream ({kind}).")

    async def _upstream_5xx(self, pod: Pod, upstream: aiohttp.ClientResponse) -> RetryableFailure:
        try:
            snippet = (await upstream.content.read(ERROR_SNIPPET)).decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            snippet = ""
        self._metrics.upstream_errors.labels(pod.name, f"status_{upstream.status}").inc()
        detail = f": {snippet.strip()}" if snippet.strip() else ""
        message = f"Pod {pod.name} answered HTTP {upstream.status}{detail}"
        self._pods.report_server_error(pod, message)
        return RetryableFailure(upstream_failed(message), "status_5xx", upstream.status)
