"""``vllm``: ``POST /reset_prefix_cache`` (served when the engine runs with ``VLLM_SERVER_DEV_MODE=1``).
A ``{"success": false}`` body or a 4xx is a refusal (blocks still in use); 404 means dev mode is off."""

from __future__ import annotations

import aiohttp

from gateway.backends.registry import Pod
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.workflow.actions import FlushOutcome, post_flush


class VllmCacheController:
    name = "vllm"

    async def flush(self, session: aiohttp.ClientSession, pod: Pod) -> tuple[FlushOutcome, str]:
        status, text = await post_flush(session, f"{pod.url}/reset_prefix_cache")
        if status == 0:
            return "refused", text
        if status == 404:
            return "failed", "no /reset_prefix_cache (is VLLM_SERVER_DEV_MODE=1 set?)"
        if status >= 500:
            return "refused", f"HTTP {status}"
        if status >= 400 or '"success": false' in text or '"success":false' in text:
            return "refused", text[:200] or f"HTTP {status}"
        return "done", text[:200]


def build(context: None, options: NoOptions) -> VllmCacheController:
    return VllmCacheController()


PLUGIN = PluginSpec(NoOptions, build)
