"""``resumable_load``: idleness counting the workflows and sessions thinking on each pod, not only the
requests in flight there."""

from __future__ import annotations

import msgspec

from gateway.plugin_api import InFlightCounts, PluginSpec, Pod, ResumableWorkingSet, RoutingRequest

# A workflow or session thinking on a pod counts this much of a request in flight there.
IDLE_WEIGHT = 0.5


class ResumableLoadScorer:
    """1 for the least busy pod, towards 0 for the busiest, where busy counts the requests in flight and
    ``idle_weight`` for each keyed context thinking between its requests there: a pod holding ten
    thinking workflows is not idle. Reads the request's own context from the placement planner."""

    name = "resumable_load"

    def __init__(self, ledger: InFlightCounts, working_set: ResumableWorkingSet,
                 idle_weight: float = IDLE_WEIGHT) -> None:
        self._ledger = ledger
        self._working_set = working_set
        self._idle_weight = idle_weight

    def busy(self, pod: Pod, request: RoutingRequest) -> float:
        thinking = self._working_set.resumable(pod.name)[1]
        own = request.context
        if own is not None and own.pod == pod.name and own.thinking:
            thinking -= 1  # the request's own context, about to resume: not someone else's load
        return self._ledger.on_pod(pod.name) + self._idle_weight * thinking

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        busy = [self.busy(p, request) for p in pods]
        busiest = max(busy)
        return [1.0 - b / busiest if busiest > 0 else 1.0 for b in busy]


class ResumableLoadOptions(msgspec.Struct, forbid_unknown_fields=True):
    idle_weight: float = IDLE_WEIGHT


PLUGIN = PluginSpec(ResumableLoadOptions, lambda context, o: ResumableLoadScorer(
    context.ledger, context.working_set, o.idle_weight))
