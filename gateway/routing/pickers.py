"""Pickers shared by policies: best score (ties broken at random) and uniform random."""

from __future__ import annotations

import random

from gateway.backends.registry import Pod
from gateway.routing.policy import Pick, RoutingRequest


class MaxScorePicker:
    name = "max_score"

    def __init__(self, reason: str, rng: random.Random | None = None) -> None:
        self._reason = reason
        self._rng = rng or random.Random()

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick:
        best = max(scores)
        tied = [p for p, s in zip(pods, scores, strict=True) if s == best]
        pod = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        return Pick(pod, self._reason, f"score {best:.3f}, {len(tied)} tied of {len(pods)}")


class RandomPicker:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RoutingRequest, pods: list[Pod], scores: list[float]) -> Pick:
        return Pick(self._rng.choice(pods), "random", f"1 of {len(pods)}")
