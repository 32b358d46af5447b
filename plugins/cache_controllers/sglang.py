"""``sglang``: ``POST /flush_cache``. SGLang refuses while requests run, sometimes with HTTP 200, so the
body decides."""

from __future__ import annotations

import aiohttp

from gateway.backends.registry import Pod
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.workflow.actions import FlushOutcome, post_flush


class SglangCacheController:
    name = "sglang"

    async def flush(self, session: aiohttp.ClientSession, pod: Pod) -> tuple[FlushOutcome, str]:
        status, text = await post_flush(session, f"{pod.url}/flush_cache")
        if status == 0:
            return "refused", text
        if status == 404:
            return "failed", "no /flush_cache"
        if "not flushed" in text.lower() or status >= 400:
            return "refused", text[:200]
        return "done", text[:200]


def build(context: None, options: NoOptions) -> SglangCacheController:
    return SglangCacheController()


PLUGIN = PluginSpec(NoOptions, build)
