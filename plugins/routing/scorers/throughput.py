"""``throughput``: the requests/s of this request's shape each pod can still take, relative to the best."""

from __future__ import annotations

from gateway.plugin_api import Needs, NoOptions, PendingLoadView, PluginSpec, Pod, RoutingRequest
from plugins.routing.load_estimates import estimate_of


class ThroughputScorer:
    """Requests/s the pod can still take for this request's signature (profile throughput times free
    share), relative to the best candidate: the deployment that serves this shape fastest wins."""

    name = "throughput"
    needs = Needs(load=True)

    def __init__(self, load: PendingLoadView) -> None:
        self._load = load

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        headroom = []
        for pod in pods:
            estimate = estimate_of(self._load, request, pod)
            capacity = 1.0 / estimate.consumption if estimate.consumption > 0 else 0.0
            rate = capacity / estimate.e2e_s if estimate.e2e_s else capacity
            headroom.append(rate * max(0.0, 1.0 - self._load.load(pod.name)))
        best = max(headroom)
        return [h / best if best > 0 else 0.0 for h in headroom]


PLUGIN = PluginSpec(NoOptions, lambda context, options: ThroughputScorer(context.load))
