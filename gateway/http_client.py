"""The one pooled HTTP client session for all upstream traffic (requests, health checks, metrics
scrapes, tokenization, cache flushes).

Owner: the :class:`HttpClient` owns the ``aiohttp.ClientSession``: it opens it when the gateway starts
(a session belongs to a running event loop) and closes it last. Components hold the client from the
moment they are built and read :attr:`HttpClient.session` once the gateway runs.
"""

from __future__ import annotations

import aiohttp


class HttpClient:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the gateway's HTTP client is used before the gateway started")
        return self._session

    @property
    def started(self) -> bool:
        return self._session is not None

    async def start(self) -> None:
        # No per-host cap: pods are few and hot.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        # No cookie jar: a pod's Set-Cookie answers one client, and must never ride on another's request.
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              cookie_jar=aiohttp.DummyCookieJar())

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
