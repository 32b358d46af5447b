"""``capacity``: the pods that can take the request without going past capacity (GPU profiles)."""

from __future__ import annotations

from gateway.plugin_api import Needs, NoOptions, PendingLoadView, PluginSpec, Pod, RoutingRequest
from plugins.routing.load_estimates import estimate_of


class CapacityFilter:
    """Keep the pods that can take the request without going past capacity (all, if none can: the
    request was admitted, so it goes to the least loaded rather than nowhere)."""

    name = "capacity"
    needs = Needs(load=True)

    def __init__(self, load: PendingLoadView) -> None:
        self._load = load

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        fit = [p for p in pods if self._load.fits(p.name, estimate_of(self._load, request, p), request.kind)]
        return fit or pods


PLUGIN = PluginSpec(NoOptions, lambda context, options: CapacityFilter(context.load))
