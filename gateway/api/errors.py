"""OpenAI-shaped errors: ``{"error": {"message", "type", "code", "param"}}`` with the right status.

Every failure the gateway reports goes through :class:`ApiError`, so clients built for the OpenAI API
parse our errors the same way they parse OpenAI's.
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

    def body(self) -> bytes:
        return _encoder.encode(ErrorEnvelope(ErrorBody(self.message, self.type, self.code, self.param)))

    def to_response(self) -> web.Response:
        return web.Response(
            status=self.status, body=self.body(), content_type="application/json", headers=self.headers
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
