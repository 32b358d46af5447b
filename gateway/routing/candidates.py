"""The pods a policy looks at for one request, when the fleet has more than it needs to look at.

Scoring every pod costs a request the whole fleet. A policy that scores looks at ``routing.max_candidates``
pods at most: the pod the request is pinned to, the pods flow control released it to (when they are few),
the pods holding the longest runs of its prompt (from the prefix index's holders of each block, when the
policy reads the prompt's tokens), and a fresh uniform sample of the rest. The sample is where a request
with nothing cached goes: its load scorer takes the least busy of them (the power of d choices: with 16
sampled, the busiest pods are almost never chosen), and a pod with a shorter cached run than the holders'
is among them as often as such pods are common.

Owner: the :class:`Shortlist` keeps nothing between requests but its random source.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from gateway.kv.index import PrefixIndex
from gateway.pods.registry import Pod, PodRegistry
from gateway.routing.policy import Policy, RoutingRequest


class Shortlist:
    def __init__(self, pods: PodRegistry, index: PrefixIndex, limit: int, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``limit``: the most pods a policy looks at (0: every pod)."""
        self._pods = pods
        self._index = index
        self.limit = limit
        self._rng = rng or random.Random()
        self._clock = clock

    def of(self, request: RoutingRequest, policy: Policy, pods: list[Pod], exclude: frozenset[str]) -> list[Pod]:
        """At most ``limit`` of the candidate ``pods`` (all of them for a policy that only picks)."""
        limit = self.limit
        if limit <= 0 or len(pods) <= limit or not policy.scorers:
            return pods
        now = self._clock()
        chosen: dict[str, Pod] = {}

        def add(name: str) -> None:
            pod = self._pods.get(name)
            if (pod is not None and name not in chosen and name not in exclude and pod.serves(request.model)
                    and pod.takes(request.leg) and pod.available(now)):
                chosen[name] = pod

        if request.pin is not None:
            add(request.pin)
        if request.room is not None and len(request.room) <= limit:
            for name in request.room:
                add(name)
        if policy.needs_tokens and request.token_ids:
            hashes = request.hashes or self._index.prompt_hashes(request.base_model or request.model,
                                                                 request.lora_name, list(request.token_ids))
            for name in self._index.holders(hashes, max(1, limit // 2)):
                add(name)
        # The rest: a uniform sample (more than needed, as some are chosen already).
        wanted = limit - len(chosen)
        for pod in self._rng.sample(pods, min(len(pods), wanted + len(chosen))):
            if len(chosen) >= limit:
                break
            chosen.setdefault(pod.name, pod)
        return list(chosen.values())
