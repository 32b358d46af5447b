"""``working_set``: how full each pod's cache is with blocks that live contexts will ask for again (the
resumable working set's demand over the pod's KV capacity). Unlike the engines' own usage gauges, which
count only blocks held by running requests, this rises while workflows think between stages; nothing
for a pod whose capacity is unknown."""

from __future__ import annotations

import time

from gateway.plugin_api import CapacityOf, NoOptions, PluginSpec, Pod, PressureContext, ResumableWorkingSet


class WorkingSetSource:
    name = "working_set"

    def __init__(self, working_set: ResumableWorkingSet, capacity_of: CapacityOf) -> None:
        self._working_set = working_set
        self._capacity_of = capacity_of

    def usage(self, pod: Pod) -> float | None:
        capacity = self._capacity_of(pod.name)
        if not capacity:
            return None
        return self._working_set.demand_tokens(pod.name, time.monotonic()) / capacity


def build(context: PressureContext, options: NoOptions) -> WorkingSetSource:
    return WorkingSetSource(context.working_set, context.capacity_of)


PLUGIN = PluginSpec(NoOptions, build)
