"""The gateway's domain errors: what went wrong, in the gateway's words, with no HTTP in them.

Everything below the HTTP edge raises a :class:`GatewayError` of one :class:`ErrorKind`; the edge
(:mod:`gateway.http_errors`) maps each kind to a status and to the error shape of the route (OpenAI's or
Anthropic's). A kind says whose fault it is and what the client may do: fix the request, retry later,
or retry elsewhere.
"""

from __future__ import annotations

import enum
import math


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"  # the client's request is malformed or not allowed as sent
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    REQUEST_TIMEOUT = "request_timeout"  # the client did not send its request in time
    TOO_LARGE = "too_large"  # the request is larger than the gateway accepts
    NOT_IMPLEMENTED = "not_implemented"  # an endpoint or feature the gateway or its pods do not serve
    RATE_LIMITED = "rate_limited"  # this client, or the gateway's admission: retry after ``retry_after_s``
    NO_POD = "no_pod"  # no healthy pod serves the model right now
    UNAVAILABLE = "unavailable"  # a store the gateway needs (the Responses API's) is not answering
    UPSTREAM_FAILED = "upstream_failed"  # the pod failed (refused, reset, 5xx)
    UPSTREAM_TIMEOUT = "upstream_timeout"
    INTERNAL = "internal"


class GatewayError(Exception):
    """A request that cannot be served, and why. ``code`` is a stable, countable name of the cause;
    ``param`` the request field at fault."""

    def __init__(self, kind: ErrorKind, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST, message, param=param, code=code)


def unknown_model(model: str) -> GatewayError:
    return GatewayError(ErrorKind.NOT_FOUND, f"model: the model `{model}` does not exist.", code="model_not_found",
                        param="model")


def unauthenticated() -> GatewayError:
    return GatewayError(ErrorKind.UNAUTHENTICATED, "Invalid API key.", code="invalid_api_key")


def not_implemented(message: str, *, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorKind.NOT_IMPLEMENTED, message, code="not_implemented", param=param)


def no_pod_available(model: str, retry_after_s: float | None = None) -> GatewayError:
    """``retry_after_s``: how soon a pod is expected back (whole seconds, rounded up, told to the client)."""
    retry = max(1, math.ceil(retry_after_s)) if retry_after_s is not None else None
    return GatewayError(ErrorKind.NO_POD, f"No healthy pod is serving model `{model}` right now; retry shortly.",
                        code="no_healthy_pod", retry_after_s=retry)


def upstream_failed(message: str) -> GatewayError:
    return GatewayError(ErrorKind.UPSTREAM_FAILED, message, code="bad_gateway")


def upstream_timeout(message: str) -> GatewayError:
    return GatewayError(ErrorKind.UPSTREAM_TIMEOUT, message, code="gateway_timeout")


def internal_error() -> GatewayError:
    return GatewayError(ErrorKind.INTERNAL, "The gateway hit an internal error; it was logged.", code="internal_error")
