"""The request path: parse, route, forward to the chosen pod, relay the answer byte for byte.

Owner: the proxy writes each pod's ``in_flight`` count (incremented before the request is sent) and
reports connection failures to the registry. One shared ``aiohttp.ClientSession`` carries all upstream
traffic. The client's body is sent upstream as received, and the pod's bytes (SSE chunks included)
reach the client unchanged: nothing on this path re-encodes JSON.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.admission import AdmissionController, Slo
from gateway.api.auth import ApiKeyAuth
from gateway.api.errors import ApiError, bad_request, unknown_model, upstream_failed, upstream_timeout
from gateway.api.middleware import REQUEST_ID
from gateway.api.requests import parse_inference_request
from gateway.backends.registry import Pod, PodRegistry
from gateway.config import AuthConfig, RoutingConfig, ServerConfig, TimeoutConfig
from gateway.load.pending import PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.logs import ACCESS_LOGGER
from gateway.metrics import GatewayMetrics
from gateway.routing.policy import Decision, Policy, RoutingRequest
from gateway.routing.router import Router
from gateway.tokenization.service import TokenizationService
from gateway.workflow.context import context_key_of
from gateway.workflow.service import NO_PLAN, RequestPlan, WorkflowService

log = logging.getLogger("gateway.proxy")
access_log = logging.getLogger(ACCESS_LOGGER)

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


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _UsageCarrier(msgspec.Struct):
    usage: Usage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageCarrier)


def usage_of_body(body: bytes) -> Usage | None:
    try:
        return _usage_decoder.decode(body).usage
    except msgspec.MsgspecError:
        return None


def usage_of_stream_tail(chunks: deque[bytes]) -> Usage | None:
    """The usage of a finished SSE stream: it rides in the last ``data:`` event that has one."""
    tail = b"".join(chunks)
    for event in reversed(tail.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data: {") and b'"usage"' in event:
            return usage_of_body(event[6:])
    return None


@dataclass(slots=True)
class Exchange:
    """What one client request went through, for metrics and the access log."""

    request_id: str
    kind: str
    started: float
    model: str = "-"
    decision: Decision | None = None
    status: int = 0
    first_byte_at: float | None = None
    attempts: int = 0
    usage: Usage | None = None
    base_model: str = "-"
    slo: Slo | None = None
    streamed_events: int = 0
    predicted_output_tokens: int = 0
    workflow: RequestPlan = field(default_factory=lambda: NO_PLAN)


class Proxy:
    def __init__(
        self,
        pods: PodRegistry,
        router: Router,
        metrics: GatewayMetrics,
        tokens: TokenizationService,
        load: PendingLoad,
        predictor: OutputLengthPredictor,
        admission: AdmissionController,
        workflows: WorkflowService,
        routing: RoutingConfig,
        timeouts: TimeoutConfig,
        auth: AuthConfig,
        key_auth: ApiKeyAuth | None = None,
        server: ServerConfig | None = None,
    ) -> None:
        self._pods = pods
        self._router = router
        self._metrics = metrics
        self._tokens = tokens
        self._load = load
        self._predictor = predictor
        self._admission = admission
        self._workflows = workflows
        self._routing = routing
        self._auth = auth
        self._server = server or ServerConfig()
        self._key_auth = key_auth
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
        # Request ids unique across replicas without the cost of uuid4 per request.
        self._id_prefix = os.urandom(6).hex()
        self._id_counter = itertools.count()
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        ex = Exchange(
            request_id=request.headers.get("x-request-id") or f"{self._id_prefix}{next(self._id_counter):x}",
            kind=kind,
            started=time.monotonic(),
        )
        request[REQUEST_ID] = ex.request_id
        try:
            response = await self._serve(request, ex)
            ex.status = response.status
            return response
        except ApiError as err:
            ex.status = err.status
            raise
        except asyncio.CancelledError:
            ex.status = 499  # the client went away first
            raise
        finally:
            self._observe(request, ex)

    async def _serve(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        body = await request.read()
        parsed = parse_inference_request(body)
        if parsed.messages is not None and len(parsed.messages) > self._server.max_messages:
            raise bad_request(f"Too many messages: {len(parsed.messages)} (at most {self._server.max_messages}).",
                              param="messages", code="too_many_messages")
        ex.model = model = parsed.model or ""
        if self._key_auth is not None:
            self._key_auth.authorize(request, model)
        if not self._pods.knows_model(model):
            raise unknown_model(model)
        override = request.headers.get("x-routing-strategy") if self._routing.allow_strategy_header else None
        policy = self._router.resolve(override)
        ex.base_model = base = self._pods.base_model(model)
        routing_request = RoutingRequest(ex.request_id, model, ex.kind, parsed, base_model=base,
                                         lora_name=model if base != model else None,
                                         context_key=context_key_of(request.headers, parsed))
        if policy.needs_tokens:
            routing_request.token_ids = await self._tokens.tokenize(model, ex.kind, parsed)
            self._check_prompt_length(model, routing_request.token_ids)
        if self._admission.config.enabled or policy.needs_load:
            await self._estimate_and_admit(request, ex, routing_request, body)
        prompt_tokens = len(routing_request.token_ids) if routing_request.token_ids else len(body) // 4
        ex.workflow = wf = self._workflows.plan(request.headers, parsed, base, prompt_tokens)
        headers = self._upstream_headers(request.headers, ex.request_id)
        exclude: set[str] = set()
        failure: RetryableFailure | None = None
        for attempt in range(self._routing.max_retries + 1):
            try:
                decision = self._router.route(routing_request, policy, frozenset(exclude), wf.pin, wf.pin_reason)
            except ApiError:
                if failure:  # every pod we could try has failed: say why, not just "none left"
                    raise failure.error from None
                raise
            decision.attempt = attempt
            ex.decision = decision
            ex.attempts = attempt + 1
            self._metrics.decision_made(decision.policy, decision.reason)
            if routing_request.token_ids is not None:
                self._metrics.prefix_hit_tokens.labels(decision.policy).observe(decision.prefix_tokens)
            try:
                return await self._attempt(request, ex, routing_request, decision, body, headers, policy)
            except RetryableFailure as exc:
                failure = exc
                exclude.add(decision.pod.name)
                self._metrics.retries.labels(decision.pod.name, exc.cause).inc()
                log.warning("request %s: pod %s failed before the first byte (%s: %s)",
                            ex.request_id, decision.pod.name, exc.cause, exc.error.message)
        assert failure is not None
        raise failure.error

    def _check_prompt_length(self, model: str, token_ids: list[int] | None) -> None:
        limit = self._server.max_prompt_tokens or self._pods.max_model_len(model)
        if token_ids is not None and limit and len(token_ids) > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {len(token_ids)}.",
                param="messages", code="context_length_exceeded")

    async def _estimate_and_admit(
        self, request: web.Request, ex: Exchange, rr: RoutingRequest, body: bytes
    ) -> None:
        parsed = rr.body
        rr.input_tokens = len(rr.token_ids) if rr.token_ids else max(1, len(body) // 4)
        rr.predicted_output_tokens = self._predictor.predict(
            rr.base_model, rr.input_tokens, parsed.max_completion_tokens or parsed.max_tokens)
        self._metrics.output_predicted.observe(rr.predicted_output_tokens)
        ex.predicted_output_tokens = rr.predicted_output_tokens
        candidates = self._pods.candidates(rr.model)
        rr.estimates = {p.name: self._load.estimate(p.name, rr.base_model, rr.input_tokens,
                                                    rr.predicted_output_tokens) for p in candidates}
        h = request.headers
        ex.slo = self._admission.slo_for(rr.base_model, h.get("x-slo-ttft-ms"), h.get("x-slo-e2e-ms"),
                                         h.get("x-priority"))
        await self._admission.admit(candidates, ex.kind, rr.estimates, ex.slo)
        if ex.slo.ttft_s is not None:
            self._metrics.slo_slack.labels("dispatch").observe(ex.slo.ttft_s - (time.monotonic() - ex.started))

    def _upstream_headers(self, incoming: CIMultiDictProxy[str], request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in incoming.items() if k.lower() not in _SKIP_REQUEST_HEADERS}
        headers["x-request-id"] = request_id
        if self._auth.upstream == "pass":
            if "authorization" in incoming:
                headers["authorization"] = incoming["authorization"]
        elif self._auth.upstream == "replace":
            headers["authorization"] = f"Bearer {self._auth.upstream_api_key}"
        return headers

    async def _attempt(
        self, request: web.Request, ex: Exchange, rr: RoutingRequest, decision: Decision, body: bytes,
        headers: dict[str, str], policy: Policy,
    ) -> web.StreamResponse:
        pod = decision.pod
        pod.in_flight += 1
        estimate = rr.estimates.get(pod.name)
        ticket = self._load.dispatch(pod.name, estimate.consumption if estimate else self._load.default_consumption,
                                     ex.kind)
        self._workflows.dispatched(ex.workflow, ex.request_id, decision, rr.base_model, rr.notes)
        try:
            upstream = await self._send(pod, request.path_qs, body, headers)
            try:
                if upstream.status >= 500:
                    raise await self._upstream_5xx(pod, upstream)
                self._pods.report_success(pod)
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    return await self._relay_stream(request, ex, decision, upstream)
                return await self._relay_body(ex, decision, upstream)
            finally:
                # On client disconnect (handler cancelled) this drops the connection: the pod sees it.
                upstream.close()
        finally:
            pod.in_flight -= 1
            self._load.finish(ticket)
            self._admission.release()
            self._workflows.finished(ex.workflow, ex.request_id, pod.name,
                                     ex.usage.prompt_tokens if ex.usage else None)
            for hook in policy.on_finished:
                hook(rr, decision)

    async def _send(
        self, pod: Pod, path: str, body: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        assert self.session is not None
        try:
            sending = self.session.post(pod.url + path, data=body, headers=headers, timeout=self._client_timeout)
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

    def _response_headers(self, ex: Exchange, decision: Decision, upstream: aiohttp.ClientResponse) -> dict:
        headers = {h: upstream.headers[h] for h in _RELAYED_RESPONSE_HEADERS if h in upstream.headers}
        headers["x-request-id"] = ex.request_id
        headers["x-gateway-pod"] = decision.pod.name
        headers["x-gateway-policy"] = decision.policy
        headers["x-gateway-prefix-tokens"] = str(decision.prefix_tokens)
        headers["x-gateway-cache-action"] = ex.workflow.header
        return headers

    async def _relay_body(
        self, ex: Exchange, decision: Decision, upstream: aiohttp.ClientResponse
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
        ex.first_byte_at = time.monotonic()
        if upstream.status == 200:
            ex.usage = usage_of_body(data)
        elif upstream.status >= 400 and not upstream.headers.get("content-type", "").startswith("application/json"):
            # An engine's own errors are OpenAI JSON and pass as they are; anything else gets that shape.
            text = data[:_UPSTREAM_ERROR_SNIPPET].decode(errors="replace").strip()
            raise ApiError(upstream.status, f"Pod {pod.name} answered HTTP {upstream.status}: {text}",
                           type="upstream_error", code=f"upstream_{upstream.status}")
        return web.Response(status=upstream.status, body=data,
                            headers=self._response_headers(ex, decision, upstream))

    async def _relay_stream(
        self, request: web.Request, ex: Exchange, decision: Decision, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        pod = decision.pod
        response = web.StreamResponse(status=upstream.status,
                                      headers=self._response_headers(ex, decision, upstream))
        await response.prepare(request)
        last_chunks: deque[bytes] = deque(maxlen=4)
        try:
            transport = request.transport
            async for chunk in self._chunks(upstream):
                if ex.first_byte_at is None:
                    ex.first_byte_at = time.monotonic()
                if transport is not None and (len(chunk) > _UNTIMED_CHUNK or transport.get_write_buffer_size()):
                    # A backlog (or a chunk that could fill the socket): the client may read slower than
                    # the pod writes. Wait for it, but not forever.
                    await self._write_or_stall(response, chunk)
                else:
                    await response.write(chunk)
                last_chunks.append(chunk)
                ex.streamed_events += chunk.count(b"data: ")
        except ClientStalled:
            self._metrics.stream_aborts.labels(pod.name, "client_stalled").inc()
            log.warning("request %s: client stalled for %g s; stream cut", ex.request_id,
                        self._server.client_stall_s)
            if request.transport is not None:
                request.transport.abort()
            ex.status = 499
            return response
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                TimeoutError) as exc:
            kind = "idle_timeout" if isinstance(exc, TimeoutError) else "mid_stream"
            self._metrics.stream_aborts.labels(pod.name, "upstream").inc()
            self._metrics.upstream_errors.labels(pod.name, kind).inc()
            log.warning("request %s: pod %s broke the stream (%s)", ex.request_id, pod.name, kind)
            error = upstream_failed(f"Pod {pod.name} stopped the stream early ({kind}).")
            await response.write(b"data: " + error.body() + b"\n\n")
            ex.status = 502
            return response
        except ConnectionResetError:
            self._metrics.stream_aborts.labels(pod.name, "client").inc()
            ex.status = 499
            return response
        ex.usage = usage_of_stream_tail(last_chunks)
        await response.write_eof()
        return response

    async def _write_or_stall(self, response: web.StreamResponse, chunk: bytes) -> None:
        try:
            async with asyncio.timeout(self._server.client_stall_s):
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

    def _observe(self, request: web.Request, ex: Exchange) -> None:
        now = time.monotonic()
        pod = ex.decision.pod.name if ex.decision else "-"
        status = ex.status or 500
        self._learn(ex)
        self._metrics.request_done(
            ex.model, pod, status, now - ex.started,
            None if ex.first_byte_at is None else ex.first_byte_at - ex.started,
            (ex.usage.prompt_tokens, ex.usage.completion_tokens) if ex.usage else None,
        )
        if access_log.isEnabledFor(logging.INFO):
            self._log_access(request, ex, now, pod, status)

    def _learn(self, ex: Exchange) -> None:
        """Feed the output-length predictor and the SLO telemetry from a finished request."""
        if ex.status != 200 or ex.kind == "embeddings":
            return
        if ex.usage is not None:
            prompt, output = ex.usage.prompt_tokens, ex.usage.completion_tokens
        elif ex.streamed_events > 2:  # no usage asked for: about one token per event, less role and [DONE]
            prompt, output = 0, ex.streamed_events - 2
        else:
            return
        if prompt:
            self._predictor.observe(ex.base_model, prompt, output)
        self._metrics.output_actual.observe(output)
        if ex.predicted_output_tokens:
            self._metrics.output_prediction_error.observe(output - ex.predicted_output_tokens)
        if ex.slo and ex.slo.ttft_s is not None and ex.first_byte_at is not None:
            self._metrics.slo_slack.labels("first_byte").observe(ex.slo.ttft_s - (ex.first_byte_at - ex.started))

    def _log_access(self, request: web.Request, ex: Exchange, now: float, pod: str, status: int) -> None:
        d = ex.decision
        ttfb_ms = round((ex.first_byte_at - ex.started) * 1000, 2) if ex.first_byte_at else None
        fields = {
            "request_id": ex.request_id, "method": request.method, "path": request.path,
            "status": status, "model": ex.model, "pod": pod,
            "policy": d.policy if d else None, "reason": d.reason if d else None,
            "prefix_tokens": d.prefix_tokens if d else 0, "attempts": ex.attempts,
            "duration_ms": round((now - ex.started) * 1000, 2), "ttfb_ms": ttfb_ms,
        }
        access_log.info(
            "%s %s %d model=%s pod=%s policy=%s reason=%s attempts=%d ms=%.2f ttfb_ms=%s id=%s",
            request.method, request.path, status, ex.model, pod, fields["policy"], fields["reason"],
            ex.attempts, fields["duration_ms"], ttfb_ms, ex.request_id, extra=fields,
        )

