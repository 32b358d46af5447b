"""``sglang``: ``POST /flush_cache``. SGLang refuses while requests run, sometimes with HTTP 200, so the
body decides."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec
from plugins.cache_controllers import FlushEndpoint


class SglangCacheController(FlushEndpoint):
    name = "sglang"
    path = "/flush_cache"
    missing = "no /flush_cache"

    def refusal(self, status: int, text: str) -> str | None:
        return text[:200] if "not flushed" in text.lower() or status >= 400 else None


def build(context: None, options: NoOptions) -> SglangCacheController:
    return SglangCacheController()


PLUGIN = PluginSpec(NoOptions, build)
