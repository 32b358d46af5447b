"""Profiles, signature lookup, Little's-law consumption and output prediction, against hand-computed
values."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from gateway.load.ledger import InFlightLedger
from gateway.load.pending import EngineStats, PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.load.slo_profiles import GpuProfile, ProfileStore, grid_index, parse_key
from gateway.pods.scraper import parse_engine_metrics, parse_lora_info

PROFILE = {
    "gpu": "a100", "cost": 1.0, "created": 100.0,
    "indexes": [[4, 8, 16], [128, 256, 512]],
    "tputs": [[10, 8, 4], [6, 5, 0], [2, 1, 0]],
    "e2e": [[0.5, 0.6, 1.0], [1.0, 1.2, 2.0], [2.0, 2.5, 4.0]],
    "ttft": [[0.05, 0.08, 0.2], [0.06, 0.1, 0.3], [0.1, 0.2, 0.5]],
    "slos": {"percentile": 90, "e2e": 5, "ttft": 0.5},
}


def profile(**changes) -> GpuProfile:
    return msgspec.convert(PROFILE | changes, GpuProfile)


@pytest.mark.parametrize(("value", "index"), [
    (1, 0), (128, 0), (180, 0), (182, 1), (256, 1), (300, 1), (362, 1), (363, 2), (512, 2), (10_000, 2),
])
def test_grid_index_rounds_at_the_geometric_midpoint(value, index):
    # Between 128 and 256 the geometric midpoint is 181.02; between 256 and 512, 362.04.
    assert grid_index([128, 256, 512], value) == index


def test_signature_capacity_and_consumption():
    p = profile()
    assert p.signature(output_tokens=9, input_tokens=300) == (1, 1)
    assert p.capacity((1, 1)) == pytest.approx(5 * 1.2)  # L = λ·W = 6 requests in flight at capacity
    assert p.capacity((1, 2)) == 0  # tput 0: the SLO cannot be met there
    store = ProfileStore(None)
    store.put("m", "a100", p)
    ledger = InFlightLedger()
    load = PendingLoad(store, ledger, default_capacity=4, deployment_of=lambda pod: "a100")
    estimate = load.estimate("pod-a", "m", input_tokens=300, output_tokens=9)
    assert estimate.consumption == pytest.approx(1 / 6) and estimate.ttft_s == 0.1 and estimate.e2e_s == 1.2
    assert math.isinf(load.estimate("pod-a", "m", 600, 9).consumption)
    assert load.estimate("pod-a", "other-model", 300, 9).consumption == 0.25  # no profile: 1/default capacity
    tickets = [ledger.dispatch(f"r{i}", "pod-a", estimate.consumption, "chat") for i in range(5)]
    assert load.load("pod-a") == pytest.approx(5 / 6)
    assert load.fits("pod-a", estimate, "chat") and not load.fits("pod-a", load.estimate("pod-a", "m", 128, 4), "chat")
    for t in tickets:
        ledger.finish(t)
    assert load.load("pod-a") == 0


def test_engine_counts_correct_the_gateways():
    ledger = InFlightLedger()
    load = PendingLoad(ProfileStore(None), ledger, default_capacity=10, deployment_of=str)
    ledger.dispatch("r", "p", 0.1, "chat")
    assert load.load("p") == pytest.approx(0.1)
    load.engine["p"] = EngineStats(running=6, waiting=0, stale=False)  # other replicas sent work too
    assert load.load("p") == pytest.approx(0.6)
    load.engine["p"] = EngineStats(running=6, waiting=2, stale=False)
    assert load.load("p") == 1.0  # requests queue inside the engine: full
    load.engine["p"].stale = True
    assert load.load("p") == pytest.approx(0.1)


def test_embedding_share_caps_embeddings_only():
    ledger = InFlightLedger()
    load = PendingLoad(ProfileStore(None), ledger, default_capacity=10, deployment_of=str, embedding_share=0.2)
    e = load.estimate("p", "m", 10, 1)
    ledger.dispatch("r1", "p", e.consumption, "embeddings")
    ledger.dispatch("r2", "p", e.consumption, "embeddings")
    assert not load.fits("p", e, "embeddings") and load.fits("p", e, "chat")


def test_newer_profile_replaces_older_only():
    store = ProfileStore(None)
    assert store.put("m", "a100", profile(created=100.0))
    assert not store.put("m", "a100", profile(created=50.0))
    assert store.put("m", "a100", profile(created=200.0)) and store.get("m", "a100").created == 200.0


def test_invalid_profiles_are_refused():
    with pytest.raises(msgspec.ValidationError, match="tputs must be 3 x 3"):
        profile(tputs=[[1, 2, 3]])


def test_key_parsing_with_underscores_in_names():
    assert parse_key("aibrix:profile_llama_3_8b_a100", ["llama_3_8b"]) == ("llama_3_8b", "a100")
    assert parse_key("aibrix:profile_m_a100", []) == ("m", "a100")
    assert parse_key("other:key", []) is None


def test_predictor_learns_the_distribution_buckets():
    predictor = OutputLengthPredictor(window_s=60, slot_s=10, rng=random.Random(0))
    # Inputs around 1,000 tokens (bucket 10): outputs 16 (70%) and 256 (30%).
    for i in range(100):
        predictor.observe("m", 1000 + i, 16 if i % 10 < 7 else 256, now=1000.0 + i * 0.1)
    draws = [predictor.predict("m", 1024, now=1011.0) for _ in range(2000)]
    assert set(draws) == {16, 256}
    assert 0.65 < draws.count(16) / len(draws) < 0.75
    p90 = OutputLengthPredictor(window_s=60, slot_s=10, percentile=90)
    p50 = OutputLengthPredictor(window_s=60, slot_s=10, percentile=50)
    for pred in (p90, p50):
        for i in range(100):
            pred.observe("m", 1000, 16 if i % 10 < 7 else 256, now=1000.0)
    assert p90.predict("m", 1000, now=1001.0) == 256 and p50.predict("m", 1000, now=1001.0) == 16
    # Other input sizes, other models and expired history fall back to the cold start.
    assert predictor.predict("m", 10, now=1011.0) == 10  # "input" cold start: as many as the input
    assert predictor.predict("other", 1000, max_tokens=50, now=1011.0) == 50
    assert predictor.predict("m", 1024, now=2000.0) == 1024


def test_parse_engine_metrics_both_flavours():
    vllm = ('# HELP x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42\n'
            'vllm:prefix_cache_hits_total{engine="0"} 100.0\nvllm:prefix_cache_queries_total 400.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\ngarbage line\n')
    assert parse_engine_metrics(vllm) == {"running": 5.0, "waiting": 1.0, "kv_usage": 0.42,
                                          "prefix_hits": 100.0, "prefix_queries": 400.0}
    sglang = 'sglang:num_running_reqs{model_name="m"} 7.0\nsglang:num_queue_reqs{model_name="m"} 0.0\n' \
             'sglang:token_usage{model_name="m"} 0.9\n'
    assert parse_engine_metrics(sglang) == {"running": 7.0, "waiting": 0.0, "kv_usage": 0.9}


def test_vllms_lora_gauge_is_read_from_its_latest_series():
    # vLLM keeps a series per label set it ever set, its value the time: the latest one is the state now.
    series = [('', 'sql', '100.5'), ('poem', 'sql,code', '101.0'), ('', '', '99.0')]
    text = "".join(f'vllm:lora_requests_info{{max_lora="2",waiting_lora_adapters="{w}",running_lora_adapters="{r}"}}'
                   f" {at}\n" for w, r, at in series)
    assert parse_lora_info(text) == (("sql", "code"), ("poem",), 2)
    assert parse_lora_info("vllm:num_requests_running 1\n") is None
