"""``adapter_resident``: the gateway's LoRA adapter placement (:mod:`gateway.models.adapters`), which the
policy context carries; every pod is kept where there is none (a router used outside a gateway)."""

from __future__ import annotations

from gateway.plugin_api import Filter, NoOptions, PluginSpec, Pod, PolicyContext, RoutingRequest


class _KeepAll:
    name = "adapter_resident"

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        return pods


def build(context: PolicyContext, options: NoOptions) -> Filter:
    return context.adapter_placement or _KeepAll()


PLUGIN = PluginSpec(NoOptions, build)
