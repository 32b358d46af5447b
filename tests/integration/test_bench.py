"""The benchmark's workloads are reproducible, and its runner measures real contenders end to end."""

from __future__ import annotations

import json

from gateway.bench.report import write_results
from gateway.bench.runner import CONTENDERS, BenchRunner
from gateway.bench.workloads import agentic, multi_turn, overload, read_trace, shared_prefix, write_trace


def test_generators_are_seeded_and_traces_round_trip(tmp_path):
    for make in (shared_prefix, multi_turn, agentic, overload):
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
    paths = write_results(results, tmp_path, {"seed": 0})
    saved = json.loads(paths["json"].read_text())
    assert [c["name"] for c in saved["contenders"]] == ["direct", "gateway-kv_aware"]
    assert {"hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "req_per_s", "errors", "policy"} <= \
        set(saved["contenders"][0])
    assert "gateway-kv_aware" in paths["md"].read_text() and paths["plot-shared-prefix"].stat().st_size > 1000
