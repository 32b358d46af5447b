"""The one middleware: every failure leaves as OpenAI error JSON, never as a traceback."""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.api.errors import ApiError, internal_error

log = logging.getLogger("gateway.api")

REQUEST_ID = web.RequestKey("request_id", str)

_HTTP_ERROR_TYPES = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _with_request_id(err.to_response(), request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind, code = _HTTP_ERROR_TYPES.get(exc.status, ("invalid_request_error", "http_error"))
        message = exc.text if exc.status != 404 else f"No route for {request.method} {request.path}."
        err = ApiError(exc.status, message or exc.reason, type=kind, code=code)
        return _with_request_id(err.to_response(), request)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _with_request_id(internal_error().to_response(), request)


def _with_request_id(response: web.Response, request: web.Request) -> web.Response:
    request_id = request.get(REQUEST_ID) or request.headers.get("x-request-id")
    if request_id:
        response.headers["x-request-id"] = request_id
    return response
