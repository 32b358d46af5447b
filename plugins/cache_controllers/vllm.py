"""``vllm``: ``POST /reset_prefix_cache`` (served when the engine runs with ``VLLM_SERVER_DEV_MODE=1``).
A ``{"success": false}`` body or a 4xx is a refusal (blocks still in use); 404 means dev mode is off."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec
from plugins.cache_controllers import FlushEndpoint


class VllmCacheController(FlushEndpoint):
    name = "vllm"
    path = "/reset_prefix_cache"
    missing = "no /reset_prefix_cache (is VLLM_SERVER_DEV_MODE=1 set?)"

    def refusal(self, status: int, text: str) -> str | None:
        if status >= 500:
            return f"HTTP {status}"
        if status >= 400 or '"success": false' in text or '"success":false' in text:
            return text[:200] or f"HTTP {status}"
        return None


def build(context: None, options: NoOptions) -> VllmCacheController:
    return VllmCacheController()


PLUGIN = PluginSpec(NoOptions, build)
