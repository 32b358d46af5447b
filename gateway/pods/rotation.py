"""Which pods a periodic task (health checks, metric scrapes) visits in one round, within a budget.

A task that visits every pod every round costs the host in proportion to the fleet: scraping 1,000 pods
twice a second is a core's worth of HTTP. With a budget of visits per second (the host's, shared by its
workers), a fleet that fits is visited whole each round, as before; a larger one is visited in turn, each
pod as often as the budget allows, the pods that matter now (those with requests in flight) first.

Owner: each :class:`Rotation` is its task's, and keeps only where the turn stands.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from gateway.pods.registry import Pod


class Rotation:
    def __init__(self, per_s: float) -> None:
        """``per_s``: visits a second at most (0: no limit)."""
        self.per_s = per_s
        self._next = 0

    def due(self, pods: list[Pod], round_s: float, first: Callable[[Pod], bool] | None = None) -> list[Pod]:
        """The pods to visit in a round of ``round_s`` seconds: all of them while they fit the budget, else
        those ``first`` names (as many as fit), then the next ones in turn."""
        budget = max(1, int(self.per_s * round_s)) if self.per_s > 0 else len(pods)
        if len(pods) <= budget:
            return pods
        chosen = {p.name: p for p in pods if first(p)} if first is not None else {}
        out = list(chosen.values())[:budget]
        start = self._next % len(pods)
        for pod in itertools.chain(pods[start:], pods[:start]):
            if len(out) >= budget:
                break
            self._next += 1
            if pod.name not in chosen:
                out.append(pod)
        return out
