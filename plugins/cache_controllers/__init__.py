"""The engines' cache controllers: each POSTs its engine's flush endpoint and reads the answer its own way."""

from __future__ import annotations

import aiohttp

from gateway.plugin_api import FlushOutcome, Pod

FLUSH_TIMEOUT = aiohttp.ClientTimeout(total=10)


class FlushEndpoint:
    """A controller that POSTs ``path`` on the pod: no answer is a refusal to retry, a 404 (``missing``
    says why) a failure, and :meth:`refusal` reads the rest of what the engine says."""

    name: str
    path: str
    missing: str

    async def flush(self, session: aiohttp.ClientSession, pod: Pod) -> tuple[FlushOutcome, str]:
        try:
            async with session.post(f"{pod.url}{self.path}", timeout=FLUSH_TIMEOUT) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return "refused", str(exc)
        if status == 404:
            return "failed", self.missing
        refused = self.refusal(status, text)
        return ("refused", refused) if refused is not None else ("done", text[:200])

    def refusal(self, status: int, text: str) -> str | None:
        """Why the engine refused (None: it flushed)."""
        raise NotImplementedError
