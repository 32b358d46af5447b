"""Every filter, preparer, scorer and picker on its own: given these pods and this request state, these
pods survive, these scores come out, this pod and reason are picked."""

from __future__ import annotations

import math
import random

import pytest

from gateway.config import HealthConfig, PlacementConfig, PodConfig
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.events import BlockStored
from gateway.kv.index import PrefixIndex
from gateway.kv.views import PodMatch
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import EngineStats, Estimate, PendingLoad
from gateway.load.slo_profiles import ProfileStore
from gateway.pods.registry import PodRegistry
from gateway.routing.policy import PlacementCost, PrefixMatch, RoutingRequest
from plugins.routing.filters.capacity import CapacityFilter
from plugins.routing.filters.overload_guard import OverloadGuard
from plugins.routing.pickers.cache_aware import CacheAwarePicker
from plugins.routing.pickers.max_score import MaxScorePicker
from plugins.routing.pickers.random import RandomPicker
from plugins.routing.pickers.round_robin import RoundRobinPicker
from plugins.routing.preparers.prefix_match import PrefixMatcher
from plugins.routing.scorers.in_flight import InFlightScorer
from plugins.routing.scorers.kv_usage import KvUsageScorer
from plugins.routing.scorers.load import LoadScorer
from plugins.routing.scorers.pending_load import PendingLoadScorer
from plugins.routing.scorers.placement import PlacementScorer
from plugins.routing.scorers.prefix import PrefixScorer
from plugins.routing.scorers.resumable_load import ResumableLoadScorer
from plugins.routing.scorers.throughput import ThroughputScorer

NAMES = ["p0", "p1", "p2"]


@pytest.fixture
def pods():
    registry = PodRegistry([PodConfig(url=f"http://{n}:1", name=n, models=["m"]) for n in NAMES], HealthConfig())
    return registry.all()


def ledger_with(running: dict[str, int], consumption: float = 0.0) -> InFlightLedger:
    ledger = InFlightLedger()
    for pod, n in running.items():
        for i in range(n):
            ledger.dispatch(f"{pod}-{i}", pod, consumption, "chat")
    return ledger


def request(**fields) -> RoutingRequest:
    return RoutingRequest("r", "m", "chat", base_model="m", **fields)


# Filters


@pytest.mark.parametrize(("running", "slack", "ratio", "kept"), [
    ({}, 8, 0.5, NAMES),  # all idle
    ({"p0": 8}, 8, 0.5, NAMES),  # exactly at least + slack: kept
    ({"p0": 9}, 8, 0.5, ["p1", "p2"]),  # past it: dropped
    ({"p0": 40, "p1": 20, "p2": 20}, 8, 0.5, ["p0", "p1", "p2"][1:]),  # ratio: 20 + max(8, 10) = 30
    ({"p0": 29, "p1": 20, "p2": 20}, 8, 0.5, NAMES),
])
def test_overload_guard(pods, running, slack, ratio, kept):
    guard = OverloadGuard(ledger_with(running), slack, ratio)
    assert [p.name for p in guard.filter(request(), pods)] == kept


@pytest.mark.parametrize(("loads", "emergency", "kept"), [
    ({}, set(), NAMES),
    ({"p0": 0.95}, set(), ["p1", "p2"]),  # 0.95 + 0.1 > 1
    ({"p0": 0.95, "p1": 0.95, "p2": 0.95}, set(), NAMES),  # none fits: all (admission let it in)
    ({}, {"p1"}, ["p0", "p2"]),  # a pod in a KV-memory emergency is full
])
def test_capacity_filter(pods, loads, emergency, kept):
    ledger = InFlightLedger()
    for pod, load in loads.items():
        ledger.dispatch(f"{pod}-r", pod, load, "chat")
    load = PendingLoad(ProfileStore(None), ledger, 10, str, blocked=emergency.__contains__)
    rr = request(estimates={n: Estimate(0.1) for n in NAMES})
    assert [p.name for p in CapacityFilter(load).filter(rr, pods)] == kept


# Preparers


def test_prefix_matcher_precise_then_counts_the_chosen_pods_speculative_blocks(pods):
    index = PrefixIndex(speculative_ttl_s=60)
    views = {n: index.view(n, 0, "m", 4) for n in NAMES}
    index.apply(views["p1"], [BlockStored([1, 2], None, list(range(8)), 4)])
    matcher = PrefixMatcher(index, ApproximatePrefixIndex())
    rr = request(token_ids=list(range(12)))
    matcher.prepare(rr, pods)
    assert rr.precise and rr.prefix_tokens == {"p0": 0, "p1": 8, "p2": 0}
    index.expect("p2", "m", None, rr.prefix.hashes)  # routed there (gateway.request.context_steps.RoutedPrefix)
    matcher.prepare(rr, pods)  # the next attempt (or request) expects p2 to hold the prompt's blocks too
    assert rr.prefix_tokens == {"p0": 0, "p1": 8, "p2": 8}
    assert rr.prefix.pods["p2"].speculative_tokens == 8 and rr.prefix.pods["p1"].speculative_tokens == 0


def test_prefix_matcher_by_text_and_without_text(pods):
    from gateway.core.inference_api import InferenceRequest

    # A host booted seconds ago: its monotonic clock is below the history's TTL, which must not make every
    # pod look as if it had been sent every text.
    approximate = ApproximatePrefixIndex(block_chars=8, clock=lambda: 3.0)
    matcher = PrefixMatcher(None, approximate)
    body = InferenceRequest(model="m", prompt="x" * 40)
    approximate.record("x" * 40, "p0")
    rr = request(body=body)
    matcher.prepare(rr, pods)
    assert rr.precise is False and rr.prefix is not None and rr.prefix.chars == {"p0": 40, "p1": 0, "p2": 0}
    empty = request(body=InferenceRequest(model="m", prompt=[1, 2, 3]))  # token ids, no index: nothing to match
    matcher.prepare(empty, pods)
    assert empty.prefix is None and empty.precise is None


# Scorers


@pytest.mark.parametrize(("running", "scores"), [
    ({}, [1.0, 1.0, 1.0]),
    ({"p0": 4, "p1": 1, "p2": 2}, [0.25, 1.0, 0.5]),
])
def test_in_flight_scorer(pods, running, scores):
    assert InFlightScorer(ledger_with(running)).score(request(), pods) == scores


@pytest.mark.parametrize(("running", "scores"), [
    ({}, [1.0, 1.0, 1.0]),
    ({"p0": 4, "p1": 2}, [0.0, 0.5, 1.0]),
])
def test_load_scorer(pods, running, scores):
    assert LoadScorer(ledger_with(running)).score(request(), pods) == scores


@pytest.mark.parametrize(("blocks", "scores"), [
    ({}, [1.0, 1.0, 1.0]),
    ({"p0": 4, "p1": 2}, [0.0, 0.5, 1.0]),
    # Full caches a few blocks apart: all full (a tie the picker breaks at random, not towards p1)
    ({"p0": 1000, "p1": 985, "p2": 990}, [0.0, 0.0, 0.0]),
    ({"p0": 1000, "p1": 970, "p2": 990}, [0.0, pytest.approx(0.03), 0.0]),
])
def test_kv_usage_scorer(pods, blocks, scores):
    index = PrefixIndex()
    for name in NAMES:
        view = index.view(name, 0, "m", 1)
        if blocks.get(name):
            n = blocks[name]
            index.apply(view, [BlockStored([hash((name, i)) for i in range(n)], None, list(range(n)), 1)])
    assert KvUsageScorer(index).score(request(), pods) == scores


@pytest.mark.parametrize(("match", "scores"), [
    (None, [0.0, 0.0, 0.0]),
    # precise: GPU tokens, plus half of the offloaded ones; a view that lost events counts 0.7
    (PrefixMatch(True, pods={"p0": PodMatch(50), "p1": PodMatch(20, offload_tokens=40),
                             "p2": PodMatch(100, approximate=True)}), [0.5, 0.4, 0.7]),
    # approximate: characters matched over the text, times 0.7
    (PrefixMatch(False, text="x" * 100, chars={"p0": 100, "p1": 50, "p2": 0}), [0.7, 0.35, 0.0]),
])
def test_prefix_scorer(pods, match, scores):
    rr = request(token_ids=list(range(100)), prefix=match)
    assert PrefixScorer(offload_weight=0.5, approximate_weight=0.7).score(rr, pods) == pytest.approx(scores)


@pytest.mark.parametrize(("costs", "scores"), [
    # no overflow anywhere: the share of the prompt cached
    ({"p0": (20, 0.0), "p1": (100, 0.0), "p2": (60, 0.0)}, [0.8, 0.0, 0.4]),
    # overflow widens the scale to prompt + the worst overflow (100 + 100)
    ({"p0": (20, 100.0), "p1": (100, 0.0), "p2": (60, 0.0)}, [0.4, 0.5, 0.7]),
])
def test_placement_scorer(pods, costs, scores):
    rr = request(token_ids=list(range(100)), placement={n: PlacementCost(*c) for n, c in costs.items()})
    assert PlacementScorer(PrefixScorer()).score(rr, pods) == pytest.approx(scores)


def test_placement_scorer_without_costs_is_the_prefix_share(pods):
    rr = request(token_ids=list(range(100)), prefix=PrefixMatch(True, pods={n: PodMatch(10 * i)
                                                                             for i, n in enumerate(NAMES)}))
    assert PlacementScorer(PrefixScorer()).score(rr, pods) == pytest.approx([0.0, 0.1, 0.2])


def test_resumable_load_scorer_counts_thinking_contexts_but_not_the_requests_own(pods):
    ledger = ledger_with({"p1": 1})
    ws = ResumableWorkingSet(PlacementConfig(), ledger)
    for key in ("session:a", "session:b"):
        ws.hold(key, True, "p0", 4, [hash(key)], 4, now=0.0)
        ws.idle(key, now=0.0)
    scorer = ResumableLoadScorer(ledger, ws, idle_weight=0.5)
    assert scorer.score(request(), pods) == [0.0, 0.0, 1.0]  # p0: 2 x 0.5 thinking = p1's one request
    own = request(context=ws.context("session:a"))
    assert scorer.score(own, pods) == [0.5, 0.0, 1.0]  # a's own context resumes: only b thinks on p0


@pytest.mark.parametrize(("loads", "scores"), [
    ({}, [0.9, 0.9, 0.9]),
    ({"p0": 0.5, "p1": 0.95}, [0.4, 0.0, 0.9]),  # floored at 0
])
def test_pending_load_scorer(pods, loads, scores):
    ledger = InFlightLedger()
    for pod, load in loads.items():
        ledger.dispatch(f"{pod}-r", pod, load, "chat")
    load = PendingLoad(ProfileStore(None), ledger, 10, str)
    rr = request(estimates={n: Estimate(0.1) for n in NAMES})
    assert PendingLoadScorer(load).score(rr, pods) == pytest.approx(scores)


def test_pending_load_counts_the_engines_queue(pods):
    load = PendingLoad(ProfileStore(None), InFlightLedger(), 10, str)
    load.engine["p2"] = EngineStats(running=3, waiting=1, stale=False)  # a queue inside the engine: full
    rr = request(estimates={n: Estimate(0.1) for n in NAMES})
    assert PendingLoadScorer(load).score(rr, pods) == pytest.approx([0.9, 0.9, 0.0])


def test_throughput_scorer_prefers_the_fastest_free_deployment(pods):
    load = PendingLoad(ProfileStore(None), ledger_with({"p1": 1}, consumption=0.5), 10, str)
    rr = request(estimates={"p0": Estimate(0.25, e2e_s=1.0), "p1": Estimate(0.25, e2e_s=1.0),
                            "p2": Estimate(0.5, e2e_s=2.0)})
    # requests/s still possible: p0 4/1 x 1.0, p1 4/1 x 0.5, p2 2/2 x 1.0 (relative to the best)
    assert ThroughputScorer(load).score(rr, pods) == pytest.approx([1.0, 0.5, 0.25])
    rr.estimates["p2"] = Estimate(math.inf)
    assert ThroughputScorer(load).score(rr, pods)[2] == 0.0


# Pickers


def test_max_score_picker_breaks_ties_at_random(pods):
    picker = MaxScorePicker("best", random.Random(1))
    assert picker.pick(request(), pods, [0.1, 0.9, 0.2]).pod.name == "p1"
    tied = {picker.pick(request(), pods, [0.5, 0.5, 0.1]).pod.name for _ in range(50)}
    assert tied == {"p0", "p1"}


def test_random_and_round_robin_pickers(pods):
    picker = RandomPicker(random.Random(2))
    assert {picker.pick(request(), pods, []).pod.name for _ in range(60)} == set(NAMES)
    rr = RoundRobinPicker()
    assert [rr.pick(request(), pods, []).pod.name for _ in range(4)] == ["p0", "p1", "p2", "p0"]


@pytest.mark.parametrize(("state", "scores", "pod", "reason"), [
    # some pod was filtered out: whatever wins, the load decided
    ({"filtered_out": {"overload_guard": ["p0"]}}, [0.0, 0.9, 0.1], "p1", "rebalanced"),
    ({"prefix": PrefixMatch(False, text="x")}, [0.1, 0.9, 0.1], "p1", "approximate"),
    ({"prefix": PrefixMatch(True), "prefix_tokens": {"p0": 64}}, [0.9, 0.1, 0.1], "p0", "cache_hit"),
    ({"prefix": PrefixMatch(True), "prefix_tokens": {"p0": 0}}, [0.9, 0.1, 0.1], "p0", "no_hit_least_loaded"),
    ({}, [0.2, 0.1, 0.9], "p2", "no_hit_least_loaded"),
    # p0 holds more of the prompt but would evict more: placement spread the request to p1
    ({"prefix": PrefixMatch(True), "prefix_tokens": {"p0": 64, "p1": 0, "p2": 0},
      "placement": {"p0": PlacementCost(36, 80.0), "p1": PlacementCost(100, 0.0), "p2": PlacementCost(100, 0.0)}},
     [0.3, 0.5, 0.4], "p1", "capacity_spread"),
])
def test_cache_aware_picker_reasons(pods, state, scores, pod, reason):
    pick = CacheAwarePicker().pick(request(**state), pods, scores)
    assert (pick.pod.name, pick.reason) == (pod, reason)
