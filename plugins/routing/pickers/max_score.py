"""``max_score``: the best total score, ties broken at random."""

from __future__ import annotations

import random

import msgspec

from gateway.plugin_api import Pick, PluginSpec, Pod, RoutingRequest


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


class MaxScoreOptions(msgspec.Struct, forbid_unknown_fields=True):
    # The decision's reason code when this picker chooses (``gateway_routing_decisions_total``).
    reason: str = "best_score"


PLUGIN = PluginSpec(MaxScoreOptions, lambda context, o: MaxScorePicker(o.reason))
