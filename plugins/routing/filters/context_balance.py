"""``context_balance``: under cache pressure, a starting workflow or session goes to the pods holding the
fewest such contexts (``kv_aware``'s ``balance_slack``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from gateway.plugin_api import CapacityOf, PluginSpec, Pod, ResumableWorkingSet, RoutingRequest

# How many more contexts than the least loaded pod a pod may hold and still take a starting one.
SLACK = 1


class ContextBalance:
    """Filter: under pressure (some candidate's resumable demand already fills its cache), a
    workflow or session that *starts* goes only to pods holding at most ``slack`` more such contexts than
    the least loaded; one that continues (or is pinned to its workflow's or session's pod) may go
    anywhere (its cache decides). When caches overflow, what survives a context's think time depends on
    how much else its pod serves meanwhile, which the token cost alone does not see: an even spread of
    contexts is what the sticky-placement oracle does."""

    name = "context_balance"

    def __init__(self, working_set: ResumableWorkingSet, capacity_of: CapacityOf, slack: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._working_set = working_set
        self._capacity_of = capacity_of
        self._slack = slack
        self._clock = clock

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        now = self._clock()
        if not self._starting(request) or not any(
                self._working_set.fills(p.name, self._capacity_of(p.name), now) for p in pods):
            return pods
        keyed = {p.name: self._working_set.resumable(p.name)[0] for p in pods}
        least = min(keyed.values())
        return [p for p in pods if keyed[p.name] <= least + self._slack]

    def _starting(self, request: RoutingRequest) -> bool:
        # A pinned request continues its workflow or session on the pin's pod, even when the working set
        # has let its context lapse (it thought for longer than predicted).
        return request.pin is None and self._working_set.starting(request.context_key, request.context_keyed)


class ContextBalanceOptions(msgspec.Struct, forbid_unknown_fields=True):
    slack: int = SLACK


PLUGIN = PluginSpec(ContextBalanceOptions, lambda context, o: ContextBalance(
    context.working_set, context.capacity_of, o.slack, context.clock))
