"""OpenAI-shaped errors: ``{"error": {"message", "type", "code", "param"}}`` with the right status.

Every failure the gateway reports goes through :class:`ApiError`, so clients built for the OpenAI API
parse our errors the same way they parse OpenAI's. On the Anthropic route (``/v1/messages``) the same
error is written in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import msgspec
from aiohttp import web


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


# Anthropic's error types by status (its docs); 503 (no pod can take it) reads as overloaded.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """An error answered to the client as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self, anthropic: bool = False) -> bytes:
        if anthropic:
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            return _encoder.encode(AnthropicErrorEnvelope(AnthropicErrorBody(kind, self.message)))
        return _encoder.encode(ErrorEnvelope(ErrorBody(self.message, self.type, self.code, self.param)))

    def to_response(self, anthropic: bool = False) -> web.Response:
        return web.Response(
            status=self.status, body=self.body(anthropic), content_type="application/json", headers=self.headers
        )


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unknown_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def unauthorized() -> ApiError:
    return ApiError(401, "Invalid API key.", type="authentication_error", code="invalid_api_key")


def no_pod_available(model: str) -> ApiError:
    return ApiError(
        503,
        f"No healthy pod is serving model `{model}` right now; retry shortly.",
        type="service_unavailable",
        code="no_healthy_pod",
    )


def upstream_failed(message: str) -> ApiError:
    return ApiError(502, message, type="upstream_error", code="bad_gateway")


def upstream_timeout(message: str) -> ApiError:
    return ApiError(504, message, type="upstream_error", code="gateway_timeout")


def internal_error() -> ApiError:
    return ApiError(500, "The gateway hit an internal error; it was logged.", type="server_error",
                    code="internal_error")
