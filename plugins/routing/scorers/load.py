"""``load``: idleness by requests in flight, relative to the busiest candidate."""

from __future__ import annotations

from gateway.plugin_api import InFlightCounts, NoOptions, PluginSpec, Pod, RoutingRequest


class LoadScorer:
    """1 for an idle pod, falling to 0 for the busiest candidate (requests in flight via this gateway)."""

    name = "load"

    def __init__(self, ledger: InFlightCounts) -> None:
        self._ledger = ledger

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        busy = [self._ledger.on_pod(p.name) for p in pods]
        busiest = max(busy)
        if busiest == 0:
            return [1.0] * len(pods)
        return [1.0 - b / busiest for b in busy]


PLUGIN = PluginSpec(NoOptions, lambda context, options: LoadScorer(context.ledger))
