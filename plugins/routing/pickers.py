"""The shipped pickers (entry points ``gateway.pickers``): each chooses one pod from the candidates and
their total scores, and says why."""

from __future__ import annotations

import random

import msgspec

from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.routing.pickers import MaxScorePicker, RandomPicker
from plugins.routing.prefix_scoring import CacheAwarePicker
from plugins.routing.round_robin import RoundRobinPicker


class MaxScoreOptions(msgspec.Struct, forbid_unknown_fields=True):
    # The decision's reason code when this picker chooses (``gateway_routing_decisions_total``).
    reason: str = "best_score"


class RandomOptions(msgspec.Struct, forbid_unknown_fields=True):
    seed: int | None = None  # for reproducible runs


MAX_SCORE = PluginSpec(MaxScoreOptions, lambda context, o: MaxScorePicker(o.reason))
RANDOM = PluginSpec(RandomOptions, lambda context, o: RandomPicker(random.Random(o.seed)))
ROUND_ROBIN = PluginSpec(NoOptions, lambda context, options: RoundRobinPicker())
CACHE_AWARE = PluginSpec(NoOptions, lambda context, options: CacheAwarePicker())
