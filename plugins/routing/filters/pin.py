"""``pin``: the workflow's or session's pod settles the choice, when it survived the other filters."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, Pick, PluginSpec, Pod, RoutingRequest


class Pin:
    """The workflow's or session's pod, when the request's pin binds and that pod survived the other
    filters: it settles the choice (reason: the pin's) after the scorers ranked every candidate. Where the
    pin did not survive, the decision names the filter that dropped it (``unpinned_by``)."""

    name = "pin"

    def settle(self, request: RoutingRequest, pods: list[Pod]) -> Pick | None:
        if request.pin is None or not request.pin_binding:
            return None
        for pod in pods:
            if pod.name == request.pin:
                return Pick(pod, request.pin_reason, "pinned")
        return None


PLUGIN = PluginSpec(NoOptions, lambda context, options: Pin())
