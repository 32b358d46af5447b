"""The shipped filters (entry points ``gateway.filters``), and the shape every shipped profile shares.

Three are the gateway's own rules, which every shipped profile declares around its own filters:
``saturated`` (flow control's pods with room) first, ``adapter_resident`` (LoRA adapter placement) next,
``pin`` (the workflow or session pin) last. The others are the policies' own: ``overload_guard``,
``context_balance`` and ``capacity`` (their classes live with the scorers they were made for).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.backends.registry import Pod
from gateway.config import PartConfig, ProfileConfig, ScorerConfig
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.routing.policy import Filter, Pick, PolicyContext, RoutingRequest
from plugins.routing.load_scoring import CapacityFilter
from plugins.routing.placement import ContextBalance
from plugins.routing.prefix_scoring import OverloadGuard


class Saturated:
    """Flow control's rule: a request released after waiting (its ``room`` set) goes to the pods that had
    room then, while any of them is left; a pinned request is exempt (its pin decides). The pods it drops
    are recorded as ``saturated``."""

    name = "saturated"

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        room = request.room
        if not room or request.pin is not None:
            return pods
        return [p for p in pods if p.name in room] or pods


class Pin:
    """The workflow's or session's pod, when the request's pin binds and that pod survived the other
    filters: it settles the choice (reason: the pin's) after the scorers ranked every candidate. Where the
    pin did not survive, the decision names the filter that dropped it (``unpinned_by``)."""

    name = "pin"

    def settle(self, request: RoutingRequest, pods: list[Pod]) -> Pick | None:
        if request.pin is None or not request.pin_binding:
            return None
        for pod in pods:
            if pod.name == request.pin:
                return Pick(pod, request.pin_reason, "pinned")
        return None


class _KeepAll:
    name = "adapter_resident"

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        return pods


def _adapter_resident(context: PolicyContext, options: NoOptions) -> Filter:
    """The gateway's LoRA adapter placement (:mod:`gateway.models.adapters`); none outside a gateway."""
    return context.adapter_placement or _KeepAll()


class OverloadGuardOptions(msgspec.Struct, forbid_unknown_fields=True):
    slack: int = 8
    ratio: float = 0.5


class ContextBalanceOptions(msgspec.Struct, forbid_unknown_fields=True):
    slack: int = 1


SATURATED = PluginSpec(NoOptions, lambda context, options: Saturated())
ADAPTER_RESIDENT = PluginSpec(NoOptions, _adapter_resident)
PIN = PluginSpec(NoOptions, lambda context, options: Pin())
OVERLOAD_GUARD = PluginSpec(OverloadGuardOptions,
                            lambda context, o: OverloadGuard(context.ledger, o.slack, o.ratio))
CONTEXT_BALANCE = PluginSpec(ContextBalanceOptions, lambda context, o: ContextBalance(
    context.working_set, context.capacity_of, o.slack, context.clock))
CAPACITY = PluginSpec(NoOptions, lambda context, options: CapacityFilter(context.load))


def part(name: str, **options: Any) -> PartConfig:
    return PartConfig(name, options)


def scorer(name: str, weight: float = 1.0, **options: Any) -> ScorerConfig:
    return ScorerConfig(name, options, weight)


def shipped(*filters: PartConfig, scorers: tuple[ScorerConfig, ...] = (), picker: PartConfig) -> ProfileConfig:
    """A shipped profile: its own filters between the gateway's (pods with room and adapter placement
    first, the pin last), its scorers and its picker."""
    return ProfileConfig(filters=[part("saturated"), part("adapter_resident"), *filters, part("pin")],
                         scorers=list(scorers), picker=picker)
