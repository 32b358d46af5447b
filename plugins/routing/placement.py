"""Placement by cost in tokens: the prompt tokens a pod saves now against the resumable contexts its LRU
would evict to make room. The ``kv_aware`` profile composes it (:mod:`plugins.routing.scorers`).

The cost model, for a request of ``P`` prompt tokens placed on pod ``p``:

- ``hit_p``: tokens of its prefix cached on ``p`` (the prefix index, from the pod's own events);
- ``F``: the request's footprint: ``P`` plus the tokens its context is still expected to add (its
  average increment per stage times the stages it is expected to have left; nothing for a one-off);
- ``W_p``: the pod's resumable demand (:mod:`gateway.kv.working_set`): distinct blocks of the other
  live or thinking contexts there plus their expected growth;
- ``C_p``: the pod's KV capacity in tokens (``vllm:cache_config_info`` ``num_gpu_blocks`` x block size,
  ``sglang:max_total_num_tokens``, or ``kv_capacity_tokens`` in the pod's config).

``cost_p = (P - hit_p) + overflow_p`` with ``overflow_p = max(0, W_p + (F - hit_p) - C_p) - max(0, W_p - C_p)``:
the tokens prefilled now, plus the tokens of resumable contexts (other workflows', or this one's own
later stages) that the pod's LRU must drop to make room for what this context brings, each of which is
recomputed when its owner comes back. Consequences:

- while a pod has room, ``overflow`` is 0 and the cost is the uncached prompt: plain prefix affinity;
- a new workflow whose role prompt is cached on a full pod goes to a pod with room when recomputing
  the role prompt there (``hit``) costs less than what its growth would push out (``F - hit``): a hot
  shared prefix is copied to a second pod instead of piling up;
- a later stage stays with its cache: elsewhere it pays its whole context again;
- a pod whose capacity is unknown never overflows (the model degrades to prefix affinity);
- a LoRA request pays ``switch_p`` more where its adapter is not in the pod's batch slots
  (:mod:`gateway.models.adapters`): its prefix is in the adapter's own namespace, so it sticks to the
  pods that ran the adapter, unless they are loaded.

The :class:`PlacementPlanner` computes these costs once per attempt (it owns the request's ``placement``
and ``context``); the :class:`PlacementScorer` turns them into scores.

Score = ``1 - cost_p / (P + max overflow + max switch)``, in ``[0, 1]``: with no overflow anywhere it is exactly the
share of the prompt cached, so traffic that fits the fleet routes as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.backends.registry import Pod
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.routing.policy import NO_NEEDS, Needs, PlacementCost, RoutingRequest
from plugins.routing.prefix_scoring import IDLE_WEIGHT, PrefixScorer

CapacityOf = Callable[[str], float | None]


class PlacementPlanner:
    """Finds the request's live context (the one context resolution named) and each candidate's cost.
    Runs after the prefix matcher, whose cached-token counts are its ``hit``. Holding the context while
    the request runs is the pipeline's (:mod:`gateway.request.context_steps`)."""

    name = "placement"

    def __init__(self, working_set: ResumableWorkingSet, capacity_of: CapacityOf, *,
                 output_tokens: int = 16, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._working_set = working_set
        self._capacity_of = capacity_of
        self._output_tokens = output_tokens

    def prepare(self, request: RoutingRequest, pods: list[Pod]) -> None:
        request.placement = {}
        request.context = None  # this decision's own (a retry or the prefill leg must not read a stale one)
        match = request.prefix
        if match is None or not match.precise or not request.token_ids:
            return
        now = self._clock()
        prompt = len(request.token_ids)
        context = request.context = self._working_set.context(request.context_key) if request.context_key else None
        stages_done = context.stages + 1 if context is not None else 1
        growth = self._working_set.forecast.expected_growth(context, request.context_keyed, stages_done)
        footprint = prompt + self._output_tokens + growth
        for pod in pods:
            hit = request.prefix_tokens.get(pod.name, 0)
            capacity = self._capacity_of(pod.name)
            overflow = 0.0
            if capacity:
                demand = self._working_set.demand_tokens(pod.name, now, exclude=context)
                overflow = max(0.0, demand + footprint - hit - capacity) - max(0.0, demand - capacity)
            request.placement[pod.name] = PlacementCost(prompt - hit, overflow, request.switch_cost.get(pod.name, 0.0))


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


class PlacementScorer:
    """``1 - cost / (P + max overflow)`` over the candidates; the plain prefix share when the planner had
    nothing to cost (no precise match)."""

    name = "placement"
    needs: Needs = NO_NEEDS  # its matcher and planner, given where it is built (plugins.routing.scorers)

    def __init__(self, prefix: PrefixScorer) -> None:
        self._prefix = prefix

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        costs = request.placement
        if not costs or request.token_ids is None:
            return self._prefix.score(request, pods)
        worst = len(request.token_ids) + max(costs[p.name].overflow for p in pods) \
            + max(costs[p.name].switch for p in pods)
        return [max(0.0, 1.0 - costs[p.name].total / worst) for p in pods]


class ResumableLoadScorer:
    """1 for the least busy pod, towards 0 for the busiest, where busy counts the requests in flight and
    ``idle_weight`` for each keyed context thinking between its requests there: a pod holding ten
    thinking workflows is not idle. Reads the request's own context from the placement planner."""

    name = "resumable_load"

    def __init__(self, ledger: InFlightLedger, working_set: ResumableWorkingSet,
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
