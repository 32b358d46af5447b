"""``routing_headers``: a pre-request hook, and the whole of what a new request hook takes (docs/routing.md).

It tells the pod why the gateway chose it: the routing profile and its reason, as two headers of each
attempt (a pod's access log or a sidecar can then split its traffic by them). One entry point names it
(``routing_headers = "plugins.hooks.routing_headers:PLUGIN"`` in ``gateway.pre_request``), one line of
config runs it (``hooks: {pre_request: [routing_headers]}``).
"""

from __future__ import annotations

import msgspec

from gateway.plugin_api import PluginSpec, PreRequestView


class RoutingHeadersOptions(msgspec.Struct, forbid_unknown_fields=True):
    policy_header: str = "x-gateway-routing-policy"
    reason_header: str = "x-gateway-routing-reason"


class RoutingHeaders:
    def __init__(self, options: RoutingHeadersOptions) -> None:
        self._options = options

    def pre_request(self, request: PreRequestView) -> dict[str, str]:
        return {self._options.policy_header: request.policy, self._options.reason_header: request.reason}


PLUGIN = PluginSpec(RoutingHeadersOptions, lambda context, options: RoutingHeaders(options))
