"""``deployment``: an example scorer, and the whole of what a new scorer takes (docs/routing.md).

It scores 1 for the pods of the named deployments (``pods[].deployment``: say the H200s) and 0 for the
rest; weighed against the prefix scorer, a request goes to a preferred pod unless another holds enough
more of its prompt. One entry point names it (``deployment = "plugins.routing.scorers.deployment:PLUGIN"`` in
``gateway.scorers``), one line of a profile uses it (``{name: deployment, weight: 0.5, options:
{prefer: [h200]}}``).
"""

from __future__ import annotations

import msgspec

from gateway.plugin_api import PluginSpec, Pod, RoutingRequest


class DeploymentOptions(msgspec.Struct, forbid_unknown_fields=True):
    prefer: list[str] = []  # deployments whose pods score 1


class DeploymentScorer:
    name = "deployment"

    def __init__(self, prefer: list[str]) -> None:
        self._prefer = frozenset(prefer)

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        return [1.0 if p.config.deployment in self._prefer else 0.0 for p in pods]


PLUGIN = PluginSpec(DeploymentOptions, lambda context, o: DeploymentScorer(o.prefer))
