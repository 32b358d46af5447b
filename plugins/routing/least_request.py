"""``least_request``: the candidate with the fewest requests in flight through this gateway.

The proxy counts a request in flight before it is sent, so a burst spreads out at once instead of
piling onto whichever pod looked idle when the burst began.
"""

from __future__ import annotations

from gateway.backends.registry import Pod
from gateway.routing.pickers import MaxScorePicker
from gateway.routing.policy import Policy, PolicyContext, RoutingRequest, WeightedScorer


class InFlightScorer:
    """1 for the least busy candidate, falling towards 0 as a pod has more in flight than it."""

    name = "in_flight"

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        least = min(p.in_flight for p in pods)
        return [1.0 / (1 + p.in_flight - least) for p in pods]


def build(context: PolicyContext) -> Policy:
    return Policy(
        name="least_request",
        picker=MaxScorePicker("least_in_flight"),
        scorers=[WeightedScorer(InFlightScorer())],
    )
