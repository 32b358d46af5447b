"""The HTTP proxy's edge: the client's aiohttp request in, the pod's answer relayed back by the proxy."""

from __future__ import annotations

from aiohttp import web

from gateway.api.records import RECORDED
from gateway.http_errors import REQUEST_ID
from gateway.proxy.forward import Proxy
from gateway.proxy.outcome import RelayOutcome, UpstreamCall
from gateway.request.body import read_body


class HttpEdge:
    """One request received by the gateway's own HTTP server (:class:`~gateway.request.edge.Edge`). After
    the director is done, ``response`` is what the client was answered with (None: it raised instead)."""

    __slots__ = ("_body_timeout_s", "_http", "_proxy", "headers", "method", "path", "response")
    fallbacks = 0  # the director itself retries on another pod
    allowed_pods = None

    def __init__(self, http: web.Request, proxy: Proxy, body_timeout_s: float | None = None) -> None:
        self._http = http
        self._proxy = proxy
        self._body_timeout_s = body_timeout_s
        self.headers = http.headers
        self.method = http.method
        self.path = http.path_qs
        self.response: web.StreamResponse | None = None

    def identified(self, request_id: str) -> None:
        self._http[REQUEST_ID] = request_id  # the middleware echoes it on errors
        self._http[RECORDED] = True  # the director records every request it identified

    async def read_body(self, max_bytes: int) -> bytes:
        return await read_body(self._http, max_bytes, self._body_timeout_s)

    async def deliver(self, call: UpstreamCall) -> RelayOutcome:
        self.response, outcome = await self._proxy.forward(call, self._http)
        return outcome
