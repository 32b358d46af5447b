"""``overload_guard``: drop pods far busier than the least busy one."""

from __future__ import annotations

import msgspec

from gateway.plugin_api import InFlightCounts, PluginSpec, Pod, RoutingRequest

# Past ``least + max(SLACK, RATIO * least)`` requests in flight, a pod is skipped (``prefix_cache`` and
# ``kv_aware`` take these as their ``overload_slack`` and ``overload_ratio``).
SLACK = 8
RATIO = 0.5


class OverloadGuard:
    """Drop pods far busier than the least busy one, so a hot prefix cannot pile onto one pod: past
    ``min + max(slack, ratio * min)`` in flight, the cache hit is traded for balance."""

    name = "overload_guard"

    def __init__(self, ledger: InFlightCounts, slack: int = SLACK, ratio: float = RATIO) -> None:
        self._ledger = ledger
        self._slack = slack
        self._ratio = ratio

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        busy = {p.name: self._ledger.on_pod(p.name) for p in pods}
        least = min(busy.values())
        limit = least + max(self._slack, self._ratio * least)
        return [p for p in pods if busy[p.name] <= limit]


class OverloadGuardOptions(msgspec.Struct, forbid_unknown_fields=True):
    slack: int = SLACK
    ratio: float = RATIO


PLUGIN = PluginSpec(OverloadGuardOptions, lambda context, o: OverloadGuard(context.ledger, o.slack, o.ratio))
