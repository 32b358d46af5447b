"""``pending_load``: 1 minus the pod's Little's-law load after taking the request."""

from __future__ import annotations

import math

from gateway.plugin_api import Needs, NoOptions, PendingLoadView, PluginSpec, Pod, RoutingRequest
from plugins.routing.load_estimates import estimate_of


class PendingLoadScorer:
    """1 minus the pod's load after taking the request (Little's law), floored at 0."""

    name = "pending_load"
    needs = Needs(load=True)

    def __init__(self, load: PendingLoadView) -> None:
        self._load = load

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        out = []
        for pod in pods:
            consumption = estimate_of(self._load, request, pod).consumption
            after = self._load.load(pod.name) + (consumption if math.isfinite(consumption) else 1.0)
            out.append(max(0.0, 1.0 - after))
        return out


PLUGIN = PluginSpec(NoOptions, lambda context, options: PendingLoadScorer(context.load))
