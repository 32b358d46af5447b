"""Errors as the client's API writes them: a status, and OpenAI's or Anthropic's error JSON.

The one place that maps the gateway's domain errors (:mod:`gateway.core.errors`) to HTTP. OpenAI's shape
is ``{"error": {"message", "type", "code", "param"}}``; on the Anthropic route (``/v1/messages``) the same
error is ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from gateway.core.errors import ErrorKind, GatewayError


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorEnvelope(msgspec.Struct):
    error: AnthropicErrorBody
    type: str = "error"


# Status and OpenAI error type of each kind.
_HTTP: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.FORBIDDEN: (403, "permission_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.REQUEST_TIMEOUT: (408, "invalid_request_error"),
    ErrorKind.TOO_LARGE: (413, "invalid_request_error"),
    ErrorKind.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorKind.NOT_IMPLEMENTED: (501, "invalid_request_error"),
    ErrorKind.UPSTREAM_FAILED: (502, "upstream_error"),
    ErrorKind.NO_POD: (503, "service_unavailable"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.UPSTREAM_TIMEOUT: (504, "upstream_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}
# OpenAI's error type for an answer's status (a pod's own error, relayed in OpenAI's shape).
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# Anthropic's error types by status (its docs); 503 (no pod can take it) reads as overloaded.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}

# Whether a retry of the same request can succeed, told to clients by ``x-should-retry`` (the header the
# OpenAI and Anthropic SDKs, and Claude Code, obey before their own status rules). Refusals of the request
# itself (its body, key, path, size, method, headers) are answered the same way every time: a retry only
# costs the client its backoff (a wrong key kept Claude Code retrying for 3 minutes). 501: an endpoint the
# pods do not serve stays unserved. A 429 or 503 passes: the client retries, after Retry-After.
NOT_RETRYABLE = frozenset({400, 401, 403, 404, 405, 413, 422, 431, 501})
RETRYABLE = frozenset({429, 503})
# A gateway 429 or 503 whose cause did not say how long: the client may try again in a second.
DEFAULT_RETRY_AFTER_S = 1
# How many times a request was already retried, as the OpenAI and Anthropic SDKs (and Claude Code, built on the
# latter) number each attempt. Other clients send nothing: their every attempt reads as a first.
RETRY_COUNT_HEADER = "x-stainless-retry-count"
# While no pod serves a model, a call gets this many retries: the first 503 says retry after Retry-After (when a
# pod may be back), the retry's 503 says ``x-should-retry: false``. Without the budget every SDK call against a
# dead fleet costs 1 + max_retries requests (3 at the SDKs' default), and a fleet coming back meets them at once.
NO_POD_RETRIES = 1

_encoder = msgspec.json.Encoder()

# The request id, stored on the aiohttp request as soon as it is known, so that errors echo it.
REQUEST_ID = web.RequestKey("request_id", str)


@dataclass(slots=True)
class HttpError:
    """An error as it goes out on the wire."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.headers = {**retry_headers(self.status), **self.headers}

    @classmethod
    def of(cls, err: GatewayError, retries: int = 0) -> HttpError:
        """The gateway's own error: a 429 or 503 always says when to retry (its cause's estimate, or 1 s), except
        to a request that already spent its retries while no pod serves the model (``retries``: the client's
        :func:`retries_sent`)."""
        status, kind = _HTTP[err.kind]
        retry_after = err.retry_after_s if err.retry_after_s is not None else DEFAULT_RETRY_AFTER_S
        headers = {"Retry-After": str(max(1, retry_after))} if status in RETRYABLE else {}
        if err.kind is ErrorKind.NO_POD and retries >= NO_POD_RETRIES:
            headers["x-should-retry"] = "false"
        return cls(status, err.message, kind, err.code, err.param, headers)

    def body(self, anthropic: bool = False) -> bytes:
        if anthropic:
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            return _encoder.encode(AnthropicErrorEnvelope(AnthropicErrorBody(kind, self.message)))
        return _encoder.encode(ErrorEnvelope(ErrorBody(self.message, self.type, self.code, self.param)))

    def to_response(self, anthropic: bool = False) -> web.Response:
        return web.Response(status=self.status, body=self.body(anthropic), content_type="application/json",
                            headers=self.headers)


def retry_headers(status: int) -> dict[str, str]:
    """``x-should-retry`` for an error of ``status``: false where a retry cannot help, true for 429 and 503,
    none otherwise (a 500, 502, 504 or 408: the client's own rules decide)."""
    if status in NOT_RETRYABLE:
        return {"x-should-retry": "false"}
    if status in RETRYABLE:
        return {"x-should-retry": "true"}
    return {}


def retries_sent(headers: Mapping[str, str]) -> int:
    """How many times the client says it already sent this request (0 when it does not say, or says nonsense)."""
    value = headers.get(RETRY_COUNT_HEADER, "")
    return int(value) if value.isdigit() and len(value) <= 3 else 0


def openai_error_type(status: int) -> str:
    return _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def status_of(err: GatewayError) -> int:
    """The HTTP status a domain error is answered with."""
    return HttpError.of(err).status


def error_event(err: GatewayError, anthropic: bool) -> bytes:
    """The last event of a stream that broke: OpenAI's bare ``data:`` line, or Anthropic's named event."""
    body = HttpError.of(err).body(anthropic)
    return b"event: error\ndata: " + body + b"\n\n" if anthropic else b"data: " + body + b"\n\n"
