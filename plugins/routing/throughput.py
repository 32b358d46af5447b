"""``throughput``: the pod that can still take the most requests/s of this request's shape, by its
deployment's profile and its current load."""

from __future__ import annotations

from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.routing.pickers import MaxScorePicker
from gateway.routing.policy import Policy, PolicyContext, WeightedScorer
from plugins.routing.load_scoring import CapacityFilter, ThroughputScorer


def build(context: PolicyContext, options: NoOptions) -> Policy:
    return Policy(name="throughput", picker=MaxScorePicker("most_headroom"),
                  filters=[CapacityFilter(context.load)],
                  scorers=[WeightedScorer(ThroughputScorer(context.load))], needs_load=True)


PLUGIN = PluginSpec(NoOptions, build)
