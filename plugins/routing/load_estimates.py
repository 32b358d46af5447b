"""What the load-aware parts (``capacity``, ``pending_load``, ``throughput``) share: a request's estimate on
a pod, as the request pipeline filled it (these parts set ``needs_load``)."""

from __future__ import annotations

from gateway.plugin_api import Estimate, PendingLoadView, Pod, RoutingRequest


def estimate_of(load: PendingLoadView, request: RoutingRequest, pod: Pod) -> Estimate:
    """The pipeline's estimate for ``pod`` (it fills them for every candidate, as these policies set
    ``needs_load``), else one made now."""
    estimate = request.estimates.get(pod.name)
    if estimate is None:
        estimate = load.estimate(pod.name, request.base_model or request.model, request.input_tokens,
                                 request.predicted_output_tokens)
    return estimate
