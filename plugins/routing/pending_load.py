"""``pending_load``: the pod with the least Little's-law load after taking the request, among those
with capacity for it (profiles from Redis; a default capacity per pod without one)."""

from __future__ import annotations

from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.routing.pickers import MaxScorePicker
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.load_scoring import CapacityFilter, PendingLoadScorer


def build(context: PolicyContext, options: NoOptions) -> Policy:
    return Policy(name="pending_load", picker=MaxScorePicker("least_pending_load"),
                  filters=[CapacityFilter(context.load)],
                  scorers=[WeightedScorer(PendingLoadScorer(context.load))], needs_load=True)


PLUGIN = PluginSpec(NoOptions, build)
