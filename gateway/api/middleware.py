"""The one middleware: every failure leaves as the API's own error JSON (OpenAI's, or Anthropic's on its
route), never as a traceback."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from itertools import chain

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.core.errors import GatewayError, internal_error
from gateway.core.inference_api import ANTHROPIC_PATHS
from gateway.http_errors import REQUEST_ID, HttpError, retries_sent

log = logging.getLogger("gateway.api")


_HTTP_ERROR_TYPES = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def openai_errors(max_header_bytes: int) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The middleware, with the header-size limit it enforces first."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        anthropic = request.path in ANTHROPIC_PATHS  # errors in Anthropic's shape there
        if sum(map(len, chain.from_iterable(request.raw_headers))) > max_header_bytes:
            too_large = HttpError(431, f"Request headers exceed {max_header_bytes} bytes.", code="headers_too_large")
            return _with_request_id(too_large.to_response(anthropic), request)
        try:
            return await handler(request)
        except GatewayError as err:
            return _with_request_id(HttpError.of(err, retries_sent(request.headers)).to_response(anthropic), request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _with_request_id(_http_error(request, exc).to_response(anthropic), request)
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return _with_request_id(HttpError.of(internal_error()).to_response(anthropic), request)

    return middleware


def _http_error(request: web.Request, exc: web.HTTPException) -> HttpError:
    kind, code = _HTTP_ERROR_TYPES.get(exc.status, ("invalid_request_error", "http_error"))
    message = exc.text if exc.status != 404 else f"No route for {request.method} {request.path}."
    return HttpError(exc.status, message or exc.reason, type=kind, code=code)


def _with_request_id(response: web.Response, request: web.Request) -> web.Response:
    request_id = request.get(REQUEST_ID) or request.headers.get("x-request-id")
    if request_id:
        response.headers["x-request-id"] = request_id
    return response
