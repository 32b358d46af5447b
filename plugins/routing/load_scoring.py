"""Parts of the load-aware policies: a capacity filter and Little's-law scorers.

The ``pending_load``, ``throughput`` and ``slo`` profiles compose these (:mod:`plugins.routing.scorers`).
Each reads the request's per-pod estimates (filled by the request pipeline, as the policies set
``needs_load``).
"""

from __future__ import annotations

import math

from gateway.backends.registry import Pod
from gateway.load.pending import Estimate, PendingLoad
from gateway.routing.policy import Needs, RoutingRequest


def estimate_of(load: PendingLoad, request: RoutingRequest, pod: Pod) -> Estimate:
    """The pipeline's estimate for ``pod`` (it fills them for every candidate, as these policies set
    ``needs_load``), else one made now."""
    estimate = request.estimates.get(pod.name)
    if estimate is None:
        estimate = load.estimate(pod.name, request.base_model or request.model, request.input_tokens,
                                 request.predicted_output_tokens)
    return estimate


class CapacityFilter:
    """Keep the pods that can take the request without going past capacity (all, if none can: the
    request was admitted, so it goes to the least loaded rather than nowhere)."""

    name = "capacity"
    needs = Needs(load=True)

    def __init__(self, load: PendingLoad) -> None:
        self._load = load

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        fit = [p for p in pods if self._load.fits(p.name, estimate_of(self._load, request, p), request.kind)]
        return fit or pods


class PendingLoadScorer:
    """1 minus the pod's load after taking the request (Little's law), floored at 0."""

    name = "pending_load"
    needs = Needs(load=True)

    def __init__(self, load: PendingLoad) -> None:
        self._load = load

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        out = []
        for pod in pods:
            consumption = estimate_of(self._load, request, pod).consumption
            after = self._load.load(pod.name) + (consumption if math.isfinite(consumption) else 1.0)
            out.append(max(0.0, 1.0 - after))
        return out


class ThroughputScorer:
    """Requests/s the pod can still take for this request's signature (profile throughput times free
    share), relative to the best candidate: the deployment that serves this shape fastest wins."""

    name = "throughput"
    needs = Needs(load=True)

    def __init__(self, load: PendingLoad) -> None:
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
