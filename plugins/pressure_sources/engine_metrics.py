"""``engine_metrics`` (default): the KV usage each pod reports (``vllm:kv_cache_usage_perc``,
``sglang:token_usage``), as last scraped; nothing while a pod's scrape is stale."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PendingLoadView, PluginSpec, Pod, PressureContext


class EngineMetricsSource:
    name = "engine_metrics"

    def __init__(self, load: PendingLoadView) -> None:
        self._load = load

    def usage(self, pod: Pod) -> float | None:
        stats = self._load.engine.get(pod.name)
        return None if stats is None or stats.stale else stats.kv_usage


def build(context: PressureContext, options: NoOptions) -> EngineMetricsSource:
    return EngineMetricsSource(context.load)


PLUGIN = PluginSpec(NoOptions, build)
