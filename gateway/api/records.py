"""Every answer recorded once, as the client saw it: in ``gateway_requests_total`` and the access log.

A request the director handles (the proxied routes, its API-key refusals included) is recorded by the
director's complete steps, with its model, pod and decision (``RequestMetrics``, ``AccessLog``); its edge marks
it :data:`RECORDED`. Every other answer is recorded here, with the status that went out, the route template
it matched (``unmatched``: none) and no model or pod: the operators' and the Responses API's own routes, a 404
or 405, the 431 the middleware answers before any handler, and aiohttp's own 400s for what is not HTTP at all
(too many headers, ``Content-Length`` beside ``Transfer-Encoding``), which its parser answers before any
middleware runs.

One place sees all of those: aiohttp's access logger, which the server calls with each answer it finished
(``AbstractAccessLogger``, given to the runner by :func:`runner_options`). A handler the server cancelled (its
client left) finishes no answer: the middleware here records it as a 499. The siblings of ``serve --workers
N`` asking for each other's metrics are not clients: not recorded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.typedefs import Handler

from gateway.http_errors import REQUEST_ID
from gateway.logs import ACCESS_LOGGER
from gateway.metrics import UNMATCHED_ROUTE, Answer, GatewayMetrics
from gateway.request.observers import access_log, log_answer
from gateway.request.types import result_of

RECORDED = web.RequestKey("recorded", bool)  # set once the request's answer is (or will be) recorded
CLIENT_LEFT = 499


class AnswerRecords:
    """Records the answers the director did not (see the module's docs)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def answered(self, request: web.BaseRequest, status: int, seconds: float) -> None:
        if request.get(RECORDED) or from_sibling(request):
            return
        request[RECORDED] = True
        request_id = request.get(REQUEST_ID) or request.headers.get("x-request-id", "-")
        self._record(request_id, request.method, request.path, _route(request), status, seconds)

    def unparsed(self, status: int, seconds: float) -> None:
        """An answer to a connection whose request never got as far as its headers (their deadline passed)."""
        self._record("-", "-", "-", UNMATCHED_ROUTE, status, seconds)

    def _record(self, request_id: str, method: str, path: str, route: str, status: int, seconds: float) -> None:
        outcome = result_of(status)
        self._metrics.request_done(Answer("-", "-", status, route, outcome), seconds, None, None)
        if access_log.isEnabledFor(logging.INFO):
            log_answer({"request_id": request_id, "method": method, "path": path, "status": status,
                        "outcome": outcome, "route": route, "model": "-", "pod": "-",
                        "duration_ms": round(seconds * 1000, 2)})

    def middleware(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        """The outermost middleware: a handler cancelled because its client left is recorded as a 499."""

        @web.middleware
        async def recording(request: web.Request, handler: Handler) -> web.StreamResponse:
            started = asyncio.get_running_loop().time()
            try:
                return await handler(request)
            except asyncio.CancelledError:
                self.answered(request, CLIENT_LEFT, asyncio.get_running_loop().time() - started)
                raise

        return recording


RECORDS_KEY = web.AppKey("answer_records", AnswerRecords)


def runner_options(app: web.Application) -> dict[str, Any]:
    """What the app's ``web.AppRunner`` needs to record every answer it finishes."""
    records = app[RECORDS_KEY]

    class Recording(AbstractAccessLogger):
        """aiohttp's access logger, called by the server for each answer it finished, its own 400s included."""

        @property
        def enabled(self) -> bool:
            return True  # the metrics count every answer, whether the access log is on or not

        def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
            records.answered(request, response.status, time)

    return {"access_log": logging.getLogger(ACCESS_LOGGER), "access_log_class": Recording}


def _route(request: web.BaseRequest) -> str:
    """The template of the route the request matched, never its path (a client's to choose)."""
    try:
        match = request.match_info  # type: ignore[attr-defined]  # a web.Request's, once the router resolved it
    except (AttributeError, AssertionError):  # the parser refused it: no route was looked for
        return UNMATCHED_ROUTE
    resource = match.route.resource if match is not None else None
    return resource.canonical if resource is not None else UNMATCHED_ROUTE


def from_sibling(request: web.BaseRequest) -> bool:
    """Whether the request came over this worker's private Unix socket (only its siblings use it)."""
    transport = request.transport
    return transport is not None and isinstance(transport.get_extra_info("sockname"), str)
