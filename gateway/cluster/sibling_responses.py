"""The Responses API's stored responses across the workers of one gateway without Redis.

Each worker keeps the responses it stored in its own memory (:class:`~gateway.responses.store.MemoryResponses`)
and, for one it does not hold, asks its siblings over their private Unix sockets (``/internal/responses/{id}``,
answered only there): a response is stored before its answer's last bytes reach the client, so the
conversation's next turn finds it on whichever worker the kernel hands the connection to. A deletion
reaches every worker. A sibling that does not answer within ``timeout_s`` counts as not holding it.

Owner: :class:`SiblingResponses` owns nothing but its connections; the records are each worker's own.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import aiohttp

from gateway.cluster.identity import WorkerIdentity
from gateway.responses.store import MemoryResponses, StoredResponse, decode

INTERNAL_PATH = "/internal/responses/{response_id}"


class SiblingResponses:
    def __init__(self, own: MemoryResponses, identity: WorkerIdentity, timeout_s: float = 1.0) -> None:
        self.own = own
        self._identity = identity
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    async def get(self, response_id: str) -> StoredResponse | None:
        stored = self.own.find(response_id)
        if stored is not None:
            return stored
        for answer in asyncio.as_completed([self._ask(i, "GET", response_id) for i in self._siblings()]):
            data = await answer
            if data:
                return decode(data)
        return None

    async def put(self, stored: StoredResponse) -> bool:
        return self.own.keep(stored)  # its id is the gateway's own, unique: no sibling holds one of it

    async def delete(self, stored: StoredResponse) -> bool:
        here = self.own.drop(stored.id)
        there = await asyncio.gather(*(self._ask(i, "DELETE", stored.id) for i in self._siblings()))
        return here or any(answer is not None for answer in there)

    def _siblings(self) -> list[int]:
        return [i for i in range(self._identity.count) if i != self._identity.index]

    async def _ask(self, index: int, method: str, response_id: str) -> bytes | None:
        """The sibling's answer (the record, or b"" for a deletion), or None when it holds none or is silent."""
        session = self._sessions.get(index)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=self._identity.http_socket(index))
            session = self._sessions[index] = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        try:
            path = INTERNAL_PATH.format(response_id=quote(response_id, safe=""))
            async with session.request(method, "http://worker" + path) as resp:
                return await resp.read() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
