"""``least_request``: the candidate with the fewest requests in flight through this gateway.

The request pipeline counts a request in flight (in the ledger) before it is sent, so a burst spreads
out at once instead of piling onto whichever pod looked idle when the burst began.
"""

from __future__ import annotations

from gateway.backends.registry import Pod
from gateway.config import ProfileConfig
from gateway.load.ledger import InFlightLedger
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.routing.policy import RoutingRequest
from plugins.routing.filters import part, scorer, shipped


class InFlightScorer:
    """1 for the least busy candidate, falling towards 0 as a pod has more in flight than it."""

    name = "in_flight"

    def __init__(self, ledger: InFlightLedger) -> None:
        self._ledger = ledger

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        busy = [self._ledger.on_pod(p.name) for p in pods]
        least = min(busy)
        return [1.0 / (1 + b - least) for b in busy]


def build(context: None, options: NoOptions) -> ProfileConfig:
    return shipped(scorers=(scorer("in_flight"),), picker=part("max_score", reason="least_in_flight"))


PLUGIN = PluginSpec(NoOptions, build)
