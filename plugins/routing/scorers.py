"""The shipped scorers (entry points ``gateway.scorers``): each scores the candidates in ``[0, 1]``, higher
is better. Their classes live with the policies they were made for; here each is built with its options
and what it needs from the rest of the policy (the prefix matcher, the placement planner)."""

from __future__ import annotations

import msgspec

from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.routing.policy import Needs, PolicyContext
from plugins.routing.least_request import InFlightScorer
from plugins.routing.load_scoring import PendingLoadScorer, ThroughputScorer
from plugins.routing.placement import PlacementPlanner, PlacementScorer, ResumableLoadScorer
from plugins.routing.prefix_scoring import (
    APPROXIMATE_WEIGHT,
    IDLE_WEIGHT,
    OFFLOAD_WEIGHT,
    KvUsageScorer,
    LoadScorer,
    PrefixScorer,
    prefix_parts,
)


class PrefixOptions(msgspec.Struct, forbid_unknown_fields=True):
    offload_weight: float = OFFLOAD_WEIGHT
    approximate_weight: float = APPROXIMATE_WEIGHT
    # True: match the prompt's tokens against the pods' KV events (the prompt is tokenized first);
    # false: its text against the gateway's own routing history.
    precise: bool = True


def _prefix(context: PolicyContext, o: PrefixOptions) -> PrefixScorer:
    matcher, scorer = prefix_parts(context, precise=o.precise, offload_weight=o.offload_weight,
                                   approximate_weight=o.approximate_weight)
    scorer.needs = Needs(preparers=(matcher,), tokens=o.precise)
    return scorer


class PlacementOptions(msgspec.Struct, forbid_unknown_fields=True):
    offload_weight: float = OFFLOAD_WEIGHT
    approximate_weight: float = APPROXIMATE_WEIGHT


def _placement(context: PolicyContext, o: PlacementOptions) -> PlacementScorer:
    matcher, prefix = prefix_parts(context, offload_weight=o.offload_weight, approximate_weight=o.approximate_weight)
    planner = PlacementPlanner(context.working_set, context.capacity_of, clock=context.clock)
    scorer = PlacementScorer(prefix)
    scorer.needs = Needs(preparers=(matcher, planner), tokens=True, places_contexts=True)
    return scorer


class ResumableLoadOptions(msgspec.Struct, forbid_unknown_fields=True):
    idle_weight: float = IDLE_WEIGHT


class KvUsageOptions(msgspec.Struct, forbid_unknown_fields=True):
    # Within this share of the fullest pod's blocks, a pod counts as full.
    as_full: float = 0.02


PREFIX = PluginSpec(PrefixOptions, _prefix)
PLACEMENT = PluginSpec(PlacementOptions, _placement)
IN_FLIGHT = PluginSpec(NoOptions, lambda context, options: InFlightScorer(context.ledger))
LOAD = PluginSpec(NoOptions, lambda context, options: LoadScorer(context.ledger))
RESUMABLE_LOAD = PluginSpec(ResumableLoadOptions, lambda context, o: ResumableLoadScorer(
    context.ledger, context.working_set, o.idle_weight))
KV_USAGE = PluginSpec(KvUsageOptions, lambda context, o: KvUsageScorer(context.index, o.as_full))
PENDING_LOAD = PluginSpec(NoOptions, lambda context, options: PendingLoadScorer(context.load))
THROUGHPUT = PluginSpec(NoOptions, lambda context, options: ThroughputScorer(context.load))
