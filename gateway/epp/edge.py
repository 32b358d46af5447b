"""The endpoint picker's edge: one ext_proc stream from Envoy is one client request.

Envoy holds the client's connection and relays the bytes; the director (the same one, with the same
steps, as the HTTP proxy's) reads the request from the stream's messages and has this edge answer Envoy:
the chosen endpoint (and fallbacks), or an immediate response. What the EPP then sees of the answer:
its headers (status, the endpoint that served it), the end of the HTTP stream (the ext_proc stream
closes), and its last bytes: from the response body messages when Envoy streams the body to the EPP, or,
without a message per chunk, from Envoy's access-log entry of the request (:mod:`gateway.epp.access_log`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import grpc

from gateway.core.errors import ErrorKind, GatewayError, bad_request, upstream_failed
from gateway.core.usage import Usage, usage_of_json_tail, usage_of_stream_tail
from gateway.epp import protocol
from gateway.epp.access_log import AccessLogs, Ended
from gateway.http_errors import HttpError, retries_sent
from gateway.pods.registry import Pod, PodRegistry
from gateway.proxy.outcome import Ending, RelayOutcome, RetryableFailure, UpstreamCall
from gateway.request.body import decode_body

log = logging.getLogger("gateway.epp")

_TAIL_CHUNKS = 4  # as the proxy keeps of a stream: the usage rides in the last events


def endpoint_of(pod: Pod) -> str:
    """``ip:port`` of a pod, as the data plane names endpoints."""
    return pod.url.split("://", 1)[1].split("/", 1)[0]


class EnvoyEdge:
    """One request's ext_proc stream (:class:`~gateway.request.edge.Edge`). Owner of nothing shared: it
    reports the answer's outcome for its pod to the registry, as the proxy does for its own."""

    def __init__(self, first: protocol.ProcessingRequest, stream: grpc.aio.ServicerContext, pods: PodRegistry,
                 access_logs: AccessLogs, *, fallbacks: int, access_log_wait_s: float) -> None:
        self._stream = stream
        self._pods = pods
        self._access_logs = access_logs
        self._access_log_wait_s = access_log_wait_s
        self.headers, self.method, self.path = protocol.request_head(first.request_headers)
        self.fallbacks = fallbacks
        allowed = protocol.subset(first)
        self.allowed_pods = None if allowed is None else frozenset(
            p.name for p in pods.all() if endpoint_of(p) in allowed)
        self._has_body = not first.request_headers.end_of_stream
        self._full_duplex = first.protocol_config.request_body_mode == protocol.FULL_DUPLEX
        self._answer_full_duplex = first.protocol_config.response_body_mode == protocol.FULL_DUPLEX
        self._raw_body = b""
        self._decoded = False
        self._request_id = ""
        self._ended: asyncio.Future[Ended] | None = None
        self.answered = False  # whether Envoy has had our answer to the request (a route or a refusal)
        self.closed = False  # the stream ended after the answer's headers: the HTTP stream is over
        self._response: protocol.ProcessingRequest | None = None  # the answer's headers, once seen
        self._first_byte_at: float | None = None

    @property
    def answer_started(self) -> bool:
        """Whether the answer's headers have been seen (the pod answered; Envoy relays the rest)."""
        return self._response is not None

    # -- the Edge protocol ------------------------------------------------------------------------

    def identified(self, request_id: str) -> None:
        self._request_id = request_id
        self._ended = self._access_logs.expect(request_id)

    async def read_body(self, max_bytes: int) -> bytes:
        if not self._has_body:
            return b""
        if not self._full_duplex:  # buffered: Envoy sends the body once its headers are answered
            await self._stream.write(protocol.CONTINUE_REQUEST_HEADERS)
        chunks = []
        size = 0
        while True:
            message = await self._read()
            if message is None:
                raise asyncio.CancelledError  # Envoy gave up on the request before its body arrived
            kind = message.WhichOneof("request")
            if kind == "request_trailers":
                await self._stream.write(protocol.CONTINUE_REQUEST_TRAILERS)
                break
            if kind != "request_body":
                raise bad_request(f"The data plane sent {kind} before the request's body ended.")
            chunks.append(message.request_body.body)
            size += len(message.request_body.body)
            if size > max_bytes:
                raise GatewayError(ErrorKind.TOO_LARGE, f"The request body exceeds {max_bytes} bytes.",
                                   code="request_too_large")
            if message.request_body.end_of_stream:
                break
        self._raw_body = b"".join(chunks)
        encoding = self.headers.get("content-encoding")
        if encoding and encoding.strip().lower() != "identity":
            self._decoded = True
            return decode_body(self._raw_body, encoding, max_bytes)
        return self._raw_body

    async def deliver(self, call: UpstreamCall) -> RelayOutcome:
        if not self.answered:
            await self._route(call)
        if self._response is None:
            await self._await_answer_headers(call)
        if call.answering is not None:
            # The served pod's answer began. Its headers are the first the EPP sees of it: a stream's come
            # before its first token (the proxy waits for that), so its prefill is taken as done early.
            call.answering()
        return await self._await_end(call)

    # -- answering Envoy ----------------------------------------------------------------------------

    async def refuse(self, error: GatewayError, anthropic: bool) -> None:
        """The request ends here: an immediate response in the API's error shape (if it is not too late)."""
        if self.answered or self.closed:
            return
        self.answered = True
        http = HttpError.of(error, retries_sent(self.headers))
        headers = dict(http.headers)
        if self._request_id:
            headers["x-request-id"] = self._request_id
        await self._stream.write(protocol.immediate(http.status, http.body(anthropic), headers))

    async def answer(self, status: int, body: bytes) -> None:
        """The request ends here with the gateway's own answer (``/v1/models``)."""
        self.answered = True
        await self._stream.write(protocol.immediate(status, body, {}))

    async def _route(self, call: UpstreamCall) -> None:
        endpoints = [endpoint_of(call.pod), *(endpoint_of(p) for p in call.fallbacks[:self.fallbacks])]
        incoming = self.headers
        edits = {k: v for k, v in call.headers.items() if incoming.get(k) != v}
        remove = [h for h in ("authorization",) if h in incoming and h not in call.headers]
        body = None
        if call.body is not self._raw_body and (self._decoded or call.body != self._raw_body):
            body = call.body
            if self._decoded:
                remove.append("content-encoding")
        self.answered = True
        for response in protocol.routed(endpoints, edits, remove, body, in_headers=not self._has_body or
                                        self._full_duplex, full_duplex=self._full_duplex,
                                        client_body=self._raw_body):
            await self._stream.write(response)

    async def _await_answer_headers(self, call: UpstreamCall) -> None:
        while True:
            message = await self._read()
            if message is None:  # the client left, or Envoy failed the request before any answer
                raise asyncio.CancelledError
            kind = message.WhichOneof("request")
            if kind == "response_headers":
                break
            await self._continue(message, kind)
        self._response = message
        self._first_byte_at = time.monotonic()
        served = self._served_pod(message, call.pod)
        answer_headers = dict(call.answer_headers)
        if served is not call.pod:
            answer_headers["x-gateway-pod"] = served.name
        await self._stream.write(protocol.answer_headers(answer_headers))
        if served is not call.pod:
            # Envoy could not get an answer from the chosen pod and took the next endpoint: that is a
            # failure before the first byte, and the director records a fallback attempt on ``served``.
            message_ = f"Pod {call.pod.name} failed before answering; the data plane took {served.name}"
            self._pods.report_connect_failure(call.pod, message_)
            raise RetryableFailure(upstream_failed(message_), "connect", served_by=served)

    def _served_pod(self, message: protocol.ProcessingRequest, chosen: Pod) -> Pod:
        served = protocol.served_endpoint(message)
        if served is None or served == endpoint_of(chosen):
            return chosen
        pod = next((p for p in self._pods.all() if endpoint_of(p) == served), None)
        if pod is None:
            log.warning("request %s: the data plane says %s served it, which is no pod of the pool",
                        self._request_id, served)
            return chosen
        return pod

    async def _await_end(self, call: UpstreamCall) -> RelayOutcome:
        assert self._response is not None
        headers = self._response.response_headers
        status = protocol.status_of(headers)
        streamed = protocol.content_type(headers).startswith("text/event-stream")
        tail: deque[bytes] = deque(maxlen=_TAIL_CHUNKS)
        body_ended = headers.end_of_stream
        while not self.closed:
            message = await self._read()
            if message is None:
                break
            kind = message.WhichOneof("request")
            if kind == "response_body":
                chunk = message.response_body.body
                if chunk:
                    tail.append(chunk)
                body_ended = message.response_body.end_of_stream
            await self._continue(message, kind)
        ending, sent = Ending.COMPLETE, status  # the status line the client got, however the answer ends
        if body_ended:
            usage = _usage(tail, streamed) if status == 200 else None
        else:
            ended = await self._access_log_entry()
            usage = _usage([ended.tail], streamed) if ended is not None and ended.tail and status == 200 else None
            if ended is not None:
                status, ending = ended.status_and_ending(status)
                if ended.upstream_connect_failed:
                    self._pods.report_connect_failure(call.pod, f"Envoy could not reach pod {call.pod.name}")
        if ending is Ending.COMPLETE and status < 500:
            self._pods.report_success(call.pod)
        elif status >= 500 and ending is Ending.COMPLETE:
            self._pods.report_server_error(call.pod, f"Pod {call.pod.name} answered HTTP {status}")
        # Envoy's answer's headers are the first this edge hears of it: its first byte, for the step timings too.
        return RelayOutcome(status, ending, self._first_byte_at, usage, headers_at=self._first_byte_at, sent=sent)

    async def _access_log_entry(self) -> Ended | None:
        """Envoy's access-log entry of this request, when Envoy streams them to us (else None at once)."""
        ended = self._ended
        if ended is None or not self._access_logs.live:
            return None
        try:
            async with asyncio.timeout(self._access_log_wait_s):
                return await asyncio.shield(ended)
        except TimeoutError:
            log.warning("request %s: no access-log entry from Envoy within %g s", self._request_id,
                        self._access_log_wait_s)
            return None

    async def _continue(self, message: protocol.ProcessingRequest, kind: str | None) -> None:
        """Let a message we only watch go on unchanged."""
        if kind == "response_body":
            if self._answer_full_duplex:
                body = message.response_body
                await self._stream.write(protocol.body_chunk(body.body, request=False,
                                                             end_of_stream=body.end_of_stream))
            else:
                await self._stream.write(protocol.CONTINUE_RESPONSE_BODY)
        elif kind == "response_trailers":
            await self._stream.write(protocol.CONTINUE_RESPONSE_TRAILERS)
        elif kind == "request_trailers":
            await self._stream.write(protocol.CONTINUE_REQUEST_TRAILERS)

    async def _read(self) -> protocol.ProcessingRequest | None:
        if self.closed:
            return None
        message = await self._stream.read()
        if message is grpc.aio.EOF:
            self.closed = True
            return None
        return message  # type: ignore[return-value]

    def close(self) -> None:
        """The stream is done with: forget the access-log entry this request may still get."""
        if self._request_id:
            self._access_logs.forget(self._request_id)


def _usage(chunks: Any, streamed: bool) -> Usage | None:
    return usage_of_stream_tail(chunks) if streamed else usage_of_json_tail(b"".join(chunks))
