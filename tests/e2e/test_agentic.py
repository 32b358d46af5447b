"""Agentic traffic on two real vLLM pods with small caches: ``gateway bench --pod-url`` replays many
concurrent workflows over shared role prompts, first straight to the pods in turn (round robin), then
through the gateway with ``kv_aware``. The hit ratios are the pods' own prefix-cache counters.

The pods here have 48 blocks of 128 tokens each (``--num-gpu-blocks-override``), so the workflows' working
set is larger than the fleet's cache: where each workflow is placed decides how much of it survives
between its stages.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from bench.runner import CONTENDERS, BenchRunner, Result
from bench.workloads import agentic_shared, text
from gateway.config import PodConfig
from tests.e2e.conftest import MODEL, VllmFleet, running_fleet

NUM_BLOCKS = 48
# The least share of the sticky-LRU oracle's hit ratio that kv_aware reaches on this trace.
ORACLE_SHARE = 0.9
# The trace's arrivals and think times are those of a machine where one stage-sized request (~700 prompt tokens,
# 8 answered, nothing cached) takes a pod up to REFERENCE_STAGE_S (0.058 s on the quiet machine the bounds were
# set on). On a slower machine they stretch by its own stage time over that: otherwise more stages overlap in
# the pods, their blocks crowd the small caches, and the hit ratio falls below what the oracle (which knows no
# overlap) allows (beside 4 CPU hogs a core, unstretched: two replicas 0.87 of it).
REFERENCE_STAGE_S = 0.08
STAGE_WORDS = 420


@pytest.fixture(scope="module")
def small_vllm(model_dir: str) -> Iterator[VllmFleet]:
    yield from running_fleet("small", model_dir, ("--num-gpu-blocks-override", str(NUM_BLOCKS)))


def actions(result: Result) -> dict[str, float]:
    return {k: v for k, v in result.extra.items() if k.startswith("action_")}


def decisions(result: Result) -> dict[str, float]:
    """The share of each kind of cache action decided, whether or not its pod could take the request when
    it was routed: "action_preserve-fallback:overload_guard" was decided as "preserve"."""
    shares: dict[str, float] = {}
    for key, share in actions(result).items():
        kind = key.removeprefix("action_").split(":")[0].removesuffix("-fallback")
        shares[kind] = shares.get(kind, 0.0) + share
    return shares


def fallbacks(result: Result, cause: str | None = None) -> float:
    """The share of requests whose pin their pod could not take (``cause``: only those unpinned so).
    "placement" is no failure: kv_aware places a workflow's small increment itself, its pod only a hint."""
    return sum(share for key, share in actions(result).items()
               if "-fallback:" in key and (cause is None or key.endswith(f":{cause}")))


def stage_time_s(fleet: VllmFleet) -> float:
    """The median of three stage-sized requests straight to a pod, each a prompt it has not seen."""
    rng, times = random.Random(), []
    for _ in range(3):
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text(rng, STAGE_WORDS)}]}
        request = urllib.request.Request(f"{fleet.pods[0].url}/v1/chat/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        began = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as answer:
            answer.read()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


@pytest.fixture(scope="module")
def slowness(small_vllm: VllmFleet) -> float:
    """How much slower than the reference this machine's pods serve a stage (at least 1: never squeezed)."""
    measured = stage_time_s(small_vllm)
    print(f"\na stage takes {measured:.3f} s here ({REFERENCE_STAGE_S} s on the reference)")
    return max(1.0, measured / REFERENCE_STAGE_S)


def bench(fleet: VllmFleet, model_dir: str, contender: str, slowness: float) -> Result:
    pods = [PodConfig(url=p.url, name=p.name, kv_events=f"tcp://127.0.0.1:{p.events_port}",
                      kv_replay=f"tcp://127.0.0.1:{p.replay_port}") for p in fleet.pods]
    runner = BenchRunner(model=MODEL, tokenizer=model_dir, existing_pods=pods, progress=False,
                         router_logs=str(fleet.pods[0].log_path.parent / "routers"))
    # Prompts stay under the pods' 2,048-token limit (~600 shared + 80 task + up to 4 tool results of
    # ~200); 30 workflows 1-4 s apart hold ~24k tokens at their peak: twice the two pods' 2 x 48 x 128.
    trace = agentic_shared(seed=3, workflows=30, min_stages=4, max_stages=5, roles=2, common_words=220,
                           role_words=80, task_words=40, tool_words=100, think_min_s=1.0 * slowness,
                           think_max_s=4.0 * slowness, rate=3.0 / slowness, max_tokens=8)
    result = runner.run(CONTENDERS[contender], trace)
    assert result.skipped is None, result.skipped
    assert result.errors == 0 and result.rejected == 0
    # Every request reached a pod once. A keep-warm refresh that gave way to a client request was aborted by
    # the engine (not counted) unless it had just finished there (counted): the only slack allowed.
    cancelled = round(result.extra.get("keep_warm_cancelled", 0.0))
    assert trace.requests <= sum(result.pod_requests) <= trace.requests + cancelled, cancelled
    # The trace's oracle, for the block size and capacity the pods' cache_config_info says: no placement
    # passes the infinite cache (up to requests overlapping in another order than the oracle's).
    assert result.infinite is not None and result.sticky_lru is not None and result.sticky_lru <= result.infinite
    assert result.hit_ratio <= result.infinite + 0.02
    return result


@pytest.fixture(scope="module")
def results(small_vllm: VllmFleet, model_dir: str, slowness: float) -> Callable[[str], Result]:
    """A contender's run, made once for the module's tests."""
    return functools.cache(lambda contender: bench(small_vllm, model_dir, contender, slowness))


def test_kv_aware_spreads_workflows_and_beats_round_robin_on_real_pods(results: Callable[[str], Result]):
    round_robin, kv_aware = results("direct"), results("gateway-kv_aware")
    print(f"round robin: hit {round_robin.hit_ratio:.3f} pods {round_robin.pod_requests}; "
          f"kv_aware: hit {kv_aware.hit_ratio:.3f} pods {kv_aware.pod_requests}; "
          f"sticky LRU {kv_aware.sticky_lru:.3f}, infinite {kv_aware.infinite:.3f}")
    assert min(kv_aware.pod_requests) > 0 and kv_aware.largest_share <= 0.75
    # Held to the oracle, a placement that keeps each workflow on one pod of this capacity (LRU): 0.94-1.04 of
    # it in the runs seen. Round robin's own ratio moves with the pods' speed (0.528-0.581 in the runs seen:
    # when a stage starts depends on when the one before it ended), so the margin over it is the smaller one.
    assert kv_aware.hit_ratio >= ORACLE_SHARE * kv_aware.sticky_lru
    assert kv_aware.hit_ratio >= round_robin.hit_ratio + 0.03


def test_two_replicas_sharing_state_act_as_one_on_real_pods(results: Callable[[str], Result]):
    """Two gateway replicas behind a round robin, sharing their state through a real Redis: each stage of a
    workflow may reach either, yet their cache actions are the single replica's and the hit ratio stays."""
    one, two = results("gateway-kv_aware"), results("gateway-kv_aware-2-replicas")
    unshared = results("gateway-kv_aware-2-replicas-unshared")
    print(f"one replica: hit {one.hit_ratio:.3f} {actions(one)}; two: hit {two.hit_ratio:.3f} {actions(two)}; "
          f"unshared: hit {unshared.hit_ratio:.3f} {actions(unshared)}")
    # A pinned pod the overload guard drops for a moment (its single core busy with a burst of stages)
    # changes where a request goes, not what was decided: the replicas must agree on the decisions.
    # The policy's own placements of a hinted pin vary run to run (0.03-0.11 on the code before and after keep
    # warm's changes, one replica or two); pins dropped by a filter or a dead pod must stay rare.
    for result in (one, two):
        assert decisions(result) and fallbacks(result) - fallbacks(result, "placement") <= 0.1
        assert fallbacks(result, "placement") <= 0.2
    kinds = decisions(one).keys() | decisions(two).keys()
    assert all(abs(decisions(two).get(k, 0.0) - decisions(one).get(k, 0.0)) <= 0.02 for k in kinds)
    # Without shared state each replica sees half of every workflow and decides differently: the check
    # above is one that can fail.
    assert any(abs(decisions(unshared).get(k, 0.0) - decisions(one).get(k, 0.0)) > 0.02
               for k in kinds | decisions(unshared).keys())
    # The hit ratio stays: held to the oracle as one replica's is (one replica's own ratio, 0.631-0.695 in the
    # runs seen, is too noisy a reference: two replicas were 0.065 below it in one, at 0.94 of the oracle).
    assert two.hit_ratio >= ORACLE_SHARE * two.sticky_lru
