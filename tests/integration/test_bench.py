"""The benchmark's workloads are reproducible, and its runner measures real contenders end to end."""

from __future__ import annotations

import json

import pytest

from gateway.bench.cli import cache_blocks_for, scaled_trace
from gateway.bench.report import write_results
from gateway.bench.runner import CONTENDERS, BenchRunner
from gateway.bench.workloads import (
    Session,
    Step,
    Trace,
    agentic,
    agentic_shared,
    longest_request_tokens,
    multi_turn,
    overload,
    read_trace,
    shared_prefix,
    working_set_tokens,
    write_trace,
)
from gateway.tokenization.hf import MOCK_TOKENIZER_DIR, HfTokenizer


def test_generators_are_seeded_and_traces_round_trip(tmp_path):
    for make in (shared_prefix, multi_turn, agentic, agentic_shared, overload):
        a, b, c = make(seed=1), make(seed=1), make(seed=2)
        assert a == b and a != c
        write_trace(a, tmp_path / "t.jsonl")
        assert read_trace(tmp_path / "t.jsonl") == a
    trace = agentic(seed=3, workflows=4)
    for session in trace.sessions:
        assert 5 <= len(session.steps) <= 10
        assert session.steps[-1].headers["x-workflow-complete"] == "true"
        assert len({s.headers["x-workflow-id"] for s in session.steps}) == 1
    groups = shared_prefix(groups=3, per_group=4)
    assert len({s.steps[0].messages[0]["content"] for s in groups.sessions}) == 3 and groups.requests == 12


def test_runner_compares_direct_and_gateway(tmp_path):
    trace = shared_prefix(seed=0, groups=2, per_group=6, shared_words=300, question_words=20, rate=20)
    runner = BenchRunner(pods=2, num_blocks=400, speed=0.0, progress=False)
    results = [runner.run(CONTENDERS[name], trace) for name in ("direct", "gateway-kv_aware")]
    direct, gateway = results
    assert direct.errors == gateway.errors == 0 and not direct.skipped and not gateway.skipped
    # Same requests, same pods: sending each group where its prefix is cached must win on hits.
    assert gateway.hit_ratio > direct.hit_ratio and gateway.hit_ratio > 0.5
    assert gateway.ttft_p50_ms > 0 and gateway.req_per_s > 0
    # The gateway's own checks of its predictions come back with its result: all exact, no drift.
    assert gateway.extra.get("prediction_exact", 0) >= trace.requests - 2 and not gateway.extra.get("drift")
    assert not direct.extra
    paths = write_results(results, tmp_path, {"seed": 0})
    saved = json.loads(paths["json"].read_text())
    assert [c["name"] for c in saved["contenders"]] == ["direct", "gateway-kv_aware"]
    assert {"hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "req_per_s", "errors", "policy"} <= \
        set(saved["contenders"][0])
    # Requests per pod come from the pods' own counters, in every output.
    for r in results:
        assert sum(r.pod_requests) == trace.requests and len(r.pod_requests) == 2
        assert r.largest_share == max(r.pod_requests) / trace.requests
    assert saved["contenders"][1]["pod_requests"] == gateway.pod_requests
    csv_row = paths["csv"].read_text().splitlines()[2].split(",")
    assert "/".join(map(str, gateway.pod_requests)) in csv_row
    assert f"| {'/'.join(map(str, gateway.pod_requests))} | {gateway.largest_share:.2f} |" in paths["md"].read_text()
    assert "gateway-kv_aware" in paths["md"].read_text() and paths["plot-shared-prefix"].stat().st_size > 1000


def test_agentic_shared_knobs_and_working_set():
    trace = scaled_trace("agentic-shared", 0, 1.0, None, ["workflows=6", "roles=2", "think_max_s=1", "min_stages=2",
                                                          "max_stages=3"])
    assert len(trace.sessions) == 6 and all(2 <= len(s.steps) <= 3 for s in trace.sessions)
    systems = [s.steps[0].messages[0]["content"] for s in trace.sessions]
    assert len(set(systems)) == 2  # two roles ...
    preamble = systems[0].split("\n")[0]
    assert all(s.startswith(preamble) for s in systems)  # ... behind one shared preamble
    thinks = [step.think_s for s in trace.sessions for step in s.steps[1:]]
    assert all(0.3 <= t <= 1 for t in thinks) and all(s.steps[0].think_s is None for s in trace.sessions)
    with pytest.raises(ValueError, match=r"unknown knob 'nope=1'.*workflows"):
        scaled_trace("agentic-shared", 0, 1.0, None, ["nope=1"])
    # A session holds its context from its first step to its last: A (10 words, then +20 after 1 s) and B
    # (5 words at 0.5 s, +5 at 2.5 s) peak together at 1 s, with 30 + 5 (+ 1 answer token per step).
    def say(n):
        return [{"role": "user", "content": " ".join(["w"] * n)}]
    overlap = Trace("t", 0, [Session("a", 0.0, [Step(say(10), 1), Step(say(20), 1, think_s=1.0)]),
                             Session("b", 0.5, [Step(say(5), 1), Step(say(5), 1, think_s=2.0)])])
    assert working_set_tokens(overlap, lambda ms: sum(len(m["content"].split()) for m in ms)) == 30 + 1 + 5 + 1
    # A's second request carries both user turns, its first answer and its own: 10 + 20 + 1 + 1.
    assert longest_request_tokens(overlap, lambda ms: sum(len(m["content"].split()) for m in ms)) == 32
    # --working-set-ratio 2 over 2 pods of 16-token blocks: the fleet holds half the peak, rounded up.
    tokenizer = HfTokenizer(MOCK_TOKENIZER_DIR)
    peak_tokens = working_set_tokens(trace, lambda m: len(tokenizer.encode_chat(m)))
    blocks = cache_blocks_for(trace, 2.0, 2, 16)
    assert blocks * 16 * 2 * 2 >= peak_tokens > (blocks - 1) * 16 * 2 * 2
    # A ratio so high that one pod could not hold the longest request: sized for that request instead,
    # as vLLM refuses to start with a cache shorter than its longest request.
    longest = longest_request_tokens(trace, lambda m: len(tokenizer.encode_chat(m)))
    assert cache_blocks_for(trace, 50.0, 2, 16) * 16 >= longest > blocks * 16 * 2 * 2 / 50
