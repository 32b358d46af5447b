"""``sglang``: ``POST /flush_cache``. SGLang refuses while requests run, sometimes with HTTP 200, so the
body decides."""

from __future__ import annotations

import aiohttp

from gateway.backends.registry import Pod
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.workflow.actions import FlushOutcome

TIMEOUT = aiohttp.ClientTimeout(total=10)


class SglangCacheController:
    name = "sglang"

    async def flush(self, session: aiohttp.ClientSession, pod: Pod) -> tuple[FlushOutcome, str]:
        try:
            async with session.post(f"{pod.url}/flush_cache", timeout=TIMEOUT) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return "refused", str(exc)
        if resp.status == 404:
            return "failed", "no /flush_cache"
        if "not flushed" in text.lower() or resp.status >= 400:
            return "refused", text[:200]
        return "done", text[:200]


def build(context: None, options: NoOptions) -> SglangCacheController:
    return SglangCacheController()


PLUGIN = PluginSpec(NoOptions, build)
