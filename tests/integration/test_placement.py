"""Placement by cost in tokens on simulated vLLM pods: the working set it weighs is learnt from real
traffic, released by workflow completion and by pressure, and it keeps a hard flush off a pod where
another context is resumable."""

from __future__ import annotations

import time

import msgspec

from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from tests.integration.test_kv_subscriber import eventually
from tests.integration.test_workflows import CONTEXT, MODEL, fleet, stage

PREAMBLE = "Tools every agent may call: search, fetch, summarise, plan, execute. " * 30


async def test_workflows_sharing_a_preamble_spread_once_a_pod_is_full(start_mock_pod, start_gateway, http):
    # Two pods of 96 blocks x 16 tokens: about three workflows' expected footprints each.
    pods = [await start_mock_pod(num_blocks=96) for _ in range(2)]
    gw = await start_gateway([msgspec.to_builtins(p.pod_config()) for p in pods], routing={"policy": "kv_aware"},
                             tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
                             placement={"default_stages": 4})
    # Each pod's capacity comes from its scraped vllm:cache_config_info.
    await eventually(lambda: all(gw.kits.load.load.engine.get(p.name) and gw.kits.load.load.engine[p.name]
                                 .kv_capacity_tokens == 96 * 16 for p in gw.kits.foundation.pods.all()))
    chosen: dict[str, str] = {}
    for w in range(6):
        history = [{"role": "system", "content": PREAMBLE + f" You are worker {w}."},
                   {"role": "user", "content": f"Task {w}: " + "inspect the logs " * 20}]
        pod, _, payload = await stage(http, gw, f"wf-{w}", "s0", history)
        history.append(payload["choices"][0]["message"])
        history.append({"role": "user", "content": "Tool result: " + "row " * 120})
        again, _, _ = await stage(http, gw, f"wf-{w}", "s1", history)
        assert again == pod  # a later stage stays with its cache
        chosen[f"wf-{w}"] = pod
    # The preamble makes the first pod a hit for everyone; the working set sends workflows elsewhere.
    counts = {name: list(chosen.values()).count(name) for name in set(chosen.values())}
    assert len(counts) == 2 and max(counts.values()) <= 4, chosen
    registry = gw.kits.foundation.metrics.registry
    spread = registry.get_sample_value("gateway_routing_decisions_total",
                                       {"policy": "kv_aware", "reason": "capacity_spread"})
    assert spread and spread >= 1
    ws = gw.kits.kv.working_set
    assert ws.context("workflow:wf-0").pod == chosen["wf-0"] and ws.forecast.growth.value > 0
    async with http.get(f"{gw.url}/debug/placement") as resp:
        view = await resp.json()
    assert {p: v["keyed"] for p, v in view["pods"].items()} == counts
    assert all(v["capacity_tokens"] == 96 * 16 and v["thinking"] == v["keyed"] for v in view["pods"].values())
    assert view["forecast"]["growth_tokens_per_stage"] > 0


async def test_completion_releases_and_pressure_lets_go_of_the_idlest(start_mock_pod, start_gateway, http):
    _, gw = await fleet(start_mock_pod, start_gateway, n=1, workflow={"hard_flush": False},
                        pressure={"interval_s": 3600, "source": "working_set"})
    ws = gw.kits.kv.working_set
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "go"}]
    for wf in ("old", "newer", "done"):
        await stage(http, gw, wf, "s1", history)
    assert {c.key for c in ws.idle_on("pod0")} == {"workflow:old", "workflow:newer", "workflow:done"}
    await stage(http, gw, "done", "s2", history, **{"x-workflow-complete": "true"})
    assert ws.context("workflow:done") is None and ws.forecast.stages.value == 2
    # The pressure source reads the working set against the scraped capacity: make the pod look full.
    gw.kits.load.load.engine["pod0"].kv_capacity_tokens = 1.0
    monitor = gw.kits.pressure.monitor
    monitor.tick()
    assert monitor.modes.mode("pod0").name == "EMERGENCY"
    assert ws.context("workflow:old") is None and ws.context("workflow:newer") is not None
    monitor.tick()
    assert ws.context("workflow:newer") is None


async def test_a_hard_flush_waits_for_a_session_resumable_on_the_pod(start_mock_pod, start_gateway, http):
    mock_pods, gw = await fleet(start_mock_pod, start_gateway, n=1,
                                placement={"default_think_s": 0.3, "min_protect_s": 0.3, "protect_margin": 1.0})
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "go"}]
    body = {"model": MODEL, "messages": history, "max_tokens": 4}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-session-id": "chat-1"}) as resp:
        assert resp.status == 200
    await stage(http, gw, "wf", "s1", history, **{"x-workflow-complete": "true"})
    executor = gw.kits.workflows.service.executor
    started = time.monotonic()
    # The session thinks for 0.3 s: the global reset waits until it lapses, then goes through.
    await eventually(lambda: executor.hard_flushes.get("pod0") == 1, within_s=10)
    assert time.monotonic() - started >= 0.2
    registry = gw.kits.foundation.metrics.registry
    assert registry.get_sample_value("gateway_cache_actions_total", {
        "action": "hard_flush_deferred", "reason": "others_on_pod", "pod": "pod0"}) >= 1
    assert not mock_pods[0].engine.cache.cached_blocks()
