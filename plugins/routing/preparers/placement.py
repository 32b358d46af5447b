"""Placement by cost in tokens: the prompt tokens a pod saves now against the resumable contexts its LRU
would evict to make room. The ``placement`` scorer reads it (:mod:`plugins.routing.scorers.placement`), which
the ``kv_aware`` policy composes.

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
and ``context``); the ``placement`` scorer turns them into scores.

Score = ``1 - cost_p / (P + max overflow + max switch)``, in ``[0, 1]``: with no overflow anywhere it is exactly the
share of the prompt cached, so traffic that fits the fleet routes as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.plugin_api import CapacityOf, PlacementCost, Pod, ResumableWorkingSet, RoutingRequest


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
