"""``kv_usage``: free cache by the prefix index, so a prefix no pod has yet goes where it evicts least."""

from __future__ import annotations

import msgspec

from gateway.plugin_api import PluginSpec, Pod, PrefixIndex, RoutingRequest

# Within this share of the fullest pod's blocks, a pod counts as full.
AS_FULL = 0.02


class KvUsageScorer:
    """1 for the pod whose cache holds the fewest blocks (by the prefix index), towards 0 for the fullest:
    a prefix no pod has yet goes where it evicts least, so hot prefixes spread over the fleet's memory.
    A pod within ``as_full`` (a share of the fullest pod's blocks) of the fullest counts as full: once every
    cache is full, a few blocks more or less are churn, not room, and such a difference would decide every
    tie between idle pods, piling new prompts onto whichever pod evicted last (on the Mooncake replay, 38%
    of the requests on one of four pods, at a lower hit ratio)."""

    name = "kv_usage"

    def __init__(self, index: PrefixIndex, as_full: float = AS_FULL) -> None:
        self._index = index
        self._as_full = as_full

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        held = [self._index.blocks_on(p.name) for p in pods]
        most = max(held)
        if not most:
            return [1.0] * len(pods)
        return [free if (free := 1.0 - h / most) > self._as_full else 0.0 for h in held]


class KvUsageOptions(msgspec.Struct, forbid_unknown_fields=True):
    as_full: float = AS_FULL


PLUGIN = PluginSpec(KvUsageOptions, lambda context, o: KvUsageScorer(context.index, o.as_full))
