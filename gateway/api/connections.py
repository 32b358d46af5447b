"""The server's connections: a client must send a request's headers within ``server.header_read_timeout_s``.

aiohttp bounds a connection that sends nothing (its keep-alive timeout, at 75 s) but not one that sends
its headers slowly: a client sending a header line every few seconds held its connection for as long as it
liked (five such clients were still open after 100 s), and enough of them use up the server's sockets. Each
connection here gets a timer when it opens, and again when the first bytes of a later request arrive on it
while it waits between requests; the timer ends when the request's headers are parsed (a request counted),
else it answers 408 and closes the connection. The body has its own limit (``server.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from gateway.http_errors import HttpError

_STATUS_LINE = b"HTTP/1.1 408 Request Timeout\r\n"


class HeaderTimedHandler(RequestHandler):
    """aiohttp's connection handler, with a deadline for each request's headers."""

    def __init__(self, *args: Any, header_timeout_s: float, on_header_timeout: HeaderTimeoutHook,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._on_header_timeout = on_header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        parsed = self._request_count
        super().data_received(data)
        if self._request_count > parsed:  # a request's headers are in: its handler runs
            self._disarm()
        elif self._header_timer is None and self._waiter is not None:  # a new request begins, idle until now
            self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self._loop.call_later(self._header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        """No request is being handled (its headers never came): the connection is the gateway's to answer
        and close. The path is unknown, so the error is in OpenAI's shape."""
        self._header_timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        error = HttpError(408, f"The request headers did not arrive within {self._header_timeout_s:g} s.",
                          code="header_timeout")
        body = error.body()
        head = [_STATUS_LINE, b"Content-Type: application/json\r\nConnection: close\r\n",
                *(f"{k}: {v}\r\n".encode() for k, v in error.headers.items()),
                f"Content-Length: {len(body)}\r\n\r\n".encode()]
        transport.write(b"".join(head) + body)
        self.force_close()
        transport.close()
        self._on_header_timeout(error.status, self._header_timeout_s)


# Told of each answer written here, which aiohttp's access logger never sees: its status and seconds taken.
HeaderTimeoutHook = Callable[[int, float], None]


class HeaderTimedServer(Server):
    def __init__(self, *args: Any, header_timeout_s: float, on_header_timeout: HeaderTimeoutHook,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.on_header_timeout = on_header_timeout

    def __call__(self) -> RequestHandler:
        return HeaderTimedHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s,
                                  on_header_timeout=self.on_header_timeout, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose connections must send each request's headers in time."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, on_header_timeout: HeaderTimeoutHook,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._on_header_timeout = on_header_timeout

    async def _make_server(self) -> Server:
        made = await super()._make_server()  # the app started, as aiohttp makes its server
        return HeaderTimedServer(made.request_handler, request_factory=made.request_factory,
                                 handler_cancellation=made.handler_cancellation, loop=made._loop,
                                 header_timeout_s=self._header_timeout_s, on_header_timeout=self._on_header_timeout,
                                 **made._kwargs)
