"""``vllm``: ``POST /reset_prefix_cache`` (served when the engine runs with ``VLLM_SERVER_DEV_MODE=1``).
A ``{"success": false}`` body or a 4xx is a refusal (blocks still in use); 404 means dev mode is off."""

from __future__ import annotations

import aiohttp

from gateway.backends.registry import Pod
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.workflow.actions import FlushOutcome

TIMEOUT = aiohttp.ClientTimeout(total=10)


class VllmCacheController:
    name = "vllm"

    async def flush(self, session: aiohttp.ClientSession, pod: Pod) -> tuple[FlushOutcome, str]:
        try:
            async with session.post(f"{pod.url}/reset_prefix_cache", timeout=TIMEOUT) as resp:
                text = await resp.text()
                if resp.status == 404:
                    return "failed", "no /reset_prefix_cache (is VLLM_SERVER_DEV_MODE=1 set?)"
                if resp.status >= 500:
                    return "refused", f"HTTP {resp.status}"
                if resp.status >= 400 or '"success": false' in text or '"success":false' in text:
                    return "refused", text[:200] or f"HTTP {resp.status}"
                return "done", text[:200]
        except (aiohttp.ClientError, TimeoutError) as exc:
            return "refused", str(exc)


def build(context: None, options: NoOptions) -> VllmCacheController:
    return VllmCacheController()


PLUGIN = PluginSpec(NoOptions, build)
