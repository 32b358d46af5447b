"""``in_flight``: idleness by requests in flight, relative to the least busy candidate."""

from __future__ import annotations

from gateway.plugin_api import InFlightCounts, NoOptions, PluginSpec, Pod, RoutingRequest


class InFlightScorer:
    """1 for the least busy candidate, falling towards 0 as a pod has more in flight than it."""

    name = "in_flight"

    def __init__(self, ledger: InFlightCounts) -> None:
        self._ledger = ledger

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        busy = [self._ledger.on_pod(p.name) for p in pods]
        least = min(busy)
        return [1.0 / (1 + b - least) for b in busy]


PLUGIN = PluginSpec(NoOptions, lambda context, options: InFlightScorer(context.ledger))
