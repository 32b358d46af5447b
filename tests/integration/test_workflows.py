"""Workflow-aware cache actions against simulated vLLM and SGLang pods."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest

from gateway.load.pending import EngineStats
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from tests.integration.test_kv_subscriber import eventually

MODEL = "mock-llama"
CONTEXT = "You are an agent planning a data migration. " * 40


async def fleet(start_mock_pod, start_gateway, n=4, flavor="vllm", **gateway_kw):
    pods = [await start_mock_pod(flavor=flavor, num_blocks=400) for _ in range(n)]
    gateway_kw.setdefault("routing", {"policy": "kv_aware"})
    gateway_kw.setdefault("tokenization", {"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}})
    gateway_kw.setdefault("workflow", {"flush_retry_base_s": 0.05, "hard_flush": True})
    gw = await start_gateway([msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"} for i, p in enumerate(pods)],
                             **gateway_kw)
    return pods, gw


async def stage(http, gw, workflow: str, stage_id: str, history: list[dict], **headers):
    body = {"model": MODEL, "messages": history, "max_tokens": 8}
    hdrs = {"x-workflow-id": workflow, "x-stage-id": stage_id, **headers}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=hdrs) as resp:
        assert resp.status == 200, await resp.text()
        payload = await resp.json()
        return resp.headers["x-gateway-pod"], resp.headers["x-gateway-cache-action"], payload


async def test_small_increments_keep_one_pods_cache_stage_after_stage(start_mock_pod, start_gateway, http):
    _, gw = await fleet(start_mock_pod, start_gateway, routing={"policy": "round_robin"})
    history = [{"role": "system", "content": CONTEXT}]
    pods, actions, cached = [], [], []
    for i in range(6):
        history.append({"role": "user", "content": f"Step {i}: continue."})
        pod, action, payload = await stage(http, gw, "wf-1", f"stage-{i}", history)
        pods.append(pod)
        actions.append(action)
        cached.append(payload["usage"]["prompt_tokens_details"]["cached_tokens"])
        history.append(payload["choices"][0]["message"])
    # Even under round robin, every stage after the first is pinned to the workflow's pod.
    assert len(set(pods)) == 1 and actions[0] == "noop"
    assert actions[1:] == ["preserve:small_increment"] * 5
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached[1:])) and cached[1] > 0
    state = await (await http.get(f"{gw.url}/v1/workflows/wf-1")).json()
    assert [s["pod"] for s in state["stages"]] == pods and state["cache"][0]["preserved"] is True


async def test_a_preserve_that_cannot_be_kept_says_why(start_mock_pod, start_gateway, http):
    """The answer to a pinned stage routed elsewhere names what dropped its pod: the overload guard (its pod
    far busier than the least busy one), or the pod's being unavailable (unhealthy here)."""
    _, gw = await fleet(start_mock_pod, start_gateway, n=2, routing={
        "policy": "kv_aware", "options": {"kv_aware": {"overload_slack": 2, "overload_ratio": 0.0}}})
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Step 0."}]
    home, action, _ = await stage(http, gw, "wf-busy", "s0", history)
    assert action == "noop"
    history.append({"role": "user", "content": "Step 1."})
    assert (await stage(http, gw, "wf-busy", "s1", history))[:2] == (home, "preserve:small_increment")
    # Three requests of other clients in flight on the workflow's pod, none elsewhere: past the slack of 2.
    ledger = gw.kits.shared.ledger
    others = [ledger.dispatch(f"other-{i}", home, 1.0, "chat") for i in range(3)]
    history.append({"role": "user", "content": "Step 2."})
    pod, action, _ = await stage(http, gw, "wf-busy", "s2", history)
    assert pod != home and action == "preserve-fallback:overload_guard"
    for entry in others:
        ledger.finish(entry)
    gw.kits.foundation.pods.get(pod).healthy = False  # the stage's new pod, which now holds its cache
    history.append({"role": "user", "content": "Step 3."})
    moved, action, _ = await stage(http, gw, "wf-busy", "s3", history)
    assert moved == home and action == "preserve-fallback:pod_unavailable"


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_flush_override_and_completion_reach_the_right_pod(start_mock_pod, start_gateway, http, flavor):
    mock_pods, gw = await fleet(start_mock_pod, start_gateway, n=2, flavor=flavor)
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "go"}]
    pod, _, _ = await stage(http, gw, "wf-2", "s1", history)
    index = int(pod[-1])
    holder, other = mock_pods[index], mock_pods[1 - index]
    assert holder.engine.cache.cached_blocks()
    # The stage that asks for the flush goes where its cache is; the flush waits for it to end there (sent
    # before the stage reached the engine, it would have been undone by it).
    assert (await stage(http, gw, "wf-2", "s2", history, **{"x-stage-cache-policy": "flush"}))[0] == pod
    executor = gw.kits.workflows.service.executor
    await eventually(lambda: executor.hard_flushes.get(pod) == 1)
    assert gw.kits.foundation.metrics.registry.get_sample_value("gateway_cache_actions_total", {
        "action": "hard_flush_deferred", "reason": "own_requests_running", "pod": pod}) >= 1
    assert not holder.engine.cache.cached_blocks()
    assert executor.hard_flushes.get(f"pod{1 - index}") is None
    # The index learns of it from the pod's own AllBlocksCleared event.
    await eventually(lambda: not gw.kits.kv.index.own_hashes(pod))
    await stage(http, gw, "wf-2", "s3", history)
    async with http.post(f"{gw.url}/v1/workflows/wf-2/complete") as resp:
        assert (await resp.json())["status"] == "completed"
    await eventually(lambda: executor.hard_flushes.get(pod) == 2)
    async with http.get(f"{gw.url}/v1/workflows/wf-2") as resp:
        assert resp.status == 404
    assert other.engine.cache.stats.evictions == 0


async def test_no_hard_flush_while_another_workflow_uses_the_pod(start_mock_pod, start_gateway, http):
    mock_pods, gw = await fleet(start_mock_pod, start_gateway, n=1)
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "go"}]
    await stage(http, gw, "wf-a", "s1", history)
    slow = {"model": MODEL, "messages": [{"role": "user", "content": "long task"}], "max_tokens": 400, "stream": True}
    mock_pods[0].engine.timing = mock_pods[0].engine.timing.__class__(speed=0.5)
    running = await http.post(f"{gw.url}/v1/chat/completions", json=slow,
                              headers={"x-workflow-id": "wf-b", "x-stage-id": "s1"})
    await eventually(lambda: gw.kits.shared.ledger.others_on("pod0", "wf-a"))
    async with http.post(f"{gw.url}/v1/workflows/wf-a/complete") as resp:
        assert resp.status == 200
    await asyncio.sleep(0.3)
    executor = gw.kits.workflows.service.executor
    assert executor.hard_flushes.get("pod0") is None  # wf-b is running there: the flush waits
    await running.read()
    await asyncio.sleep(0.3)
    assert executor.hard_flushes.get("pod0") is None  # wf-b keeps its cache there between stages
    async with http.post(f"{gw.url}/v1/workflows/wf-b/complete") as resp:
        assert resp.status == 200
    await eventually(lambda: executor.hard_flushes.get("pod0") == 1)


async def test_sglang_refusal_is_retried(start_mock_pod, start_gateway, http):
    mock_pods, gw = await fleet(start_mock_pod, start_gateway, n=1, flavor="sglang")
    pod = mock_pods[0]
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "go"}]
    await stage(http, gw, "wf-s", "s1", history)
    # A request the gateway does not know about keeps the engine busy: SGLang refuses (with HTTP 200).
    pod.engine.timing = pod.engine.timing.__class__(speed=0.3)
    direct = await http.post(f"{pod.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 300, "stream": True})
    await http.post(f"{gw.url}/v1/workflows/wf-s/complete")
    registry = gw.kits.foundation.metrics.registry
    labels = {"action": "hard_flush_refused", "reason": "workflow_complete", "pod": "pod0"}
    await eventually(lambda: (registry.get_sample_value("gateway_cache_actions_total", labels) or 0) >= 1)
    await direct.read()
    await eventually(lambda: gw.kits.workflows.service.executor.hard_flushes.get("pod0") == 1, within_s=10)
    assert not pod.engine.cache.cached_blocks()


async def test_pressure_flushes_oldest_idle_workflow_never_in_flight(start_mock_pod, start_gateway, http):
    mock_pods, gw = await fleet(start_mock_pod, start_gateway, n=1, routing={"policy": "round_robin"},
                                load={"scrape_interval_s": 0}, workflow={"hard_flush": False},
                                pressure={"interval_s": 3600})
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "go"}]
    for wf in ("old", "newer"):
        for s in ("s1", "s2"):
            await stage(http, gw, wf, s, history)
    tracker = gw.kits.workflows.service.tracker
    assert [w.id for w in tracker.idle_preserved("pod0")] == ["old", "newer"]
    mock_pods[0].engine.timing = mock_pods[0].engine.timing.__class__(speed=0.5)
    busy = await http.post(f"{gw.url}/v1/chat/completions", headers={"x-workflow-id": "busy", "x-stage-id": "s2"},
                           json={"model": MODEL, "messages": history, "max_tokens": 300, "stream": True})
    await eventually(lambda: "busy" in tracker.workflows and tracker.in_flight(tracker.workflows["busy"]) == 1)
    tracker.workflows["busy"].entries["pod0"].preserved = True
    gw.kits.load.load.engine["pod0"] = EngineStats(kv_usage=0.9, stale=False)
    monitor = gw.kits.pressure.monitor
    monitor.tick()
    assert not tracker.workflows["old"].entries["pod0"].preserved  # the oldest idle one went first
    assert tracker.workflows["newer"].entries["pod0"].preserved
    monitor.tick()
    assert not tracker.workflows["newer"].entries["pod0"].preserved
    monitor.tick()
    assert tracker.workflows["busy"].entries["pod0"].preserved  # in flight: never flushed
    gw.kits.load.load.engine["pod0"] = EngineStats(kv_usage=0.97, stale=False)
    monitor.tick()
    assert gw.kits.load.modes.in_emergency("pod0") and monitor.modes.mode("pod0").name == "EMERGENCY"
    gw.kits.load.load.engine["pod0"] = EngineStats(kv_usage=0.5, stale=False)
    monitor.tick()
    assert not gw.kits.load.modes.in_emergency("pod0")
    await busy.read()


async def test_session_affinity_sticks_and_moves_off_a_sick_pod(start_mock_pod, start_gateway, http):
    _, gw = await fleet(start_mock_pod, start_gateway, n=3, routing={"policy": "round_robin"})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    seen = set()
    for _ in range(5):
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-session-id": "s-1"}) as resp:
            seen.add(resp.headers["x-gateway-pod"])
    assert len(seen) == 1
    pod = gw.kits.foundation.pods.get(seen.pop())
    pod.healthy = False
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-session-id": "s-1"}) as resp:
        assert resp.headers["x-gateway-pod"] != pod.name and resp.headers["x-gateway-cache-action"] == "session-moved"
    unknown = await http.post(f"{gw.url}/v1/workflows/nope/complete")
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "workflow_not_found"


async def test_by_default_only_a_stage_that_asks_for_it_is_flushed_hard(start_mock_pod, start_gateway, http):
    mock_pods, gw = await fleet(start_mock_pod, start_gateway, n=1, workflow={"flush_retry_base_s": 0.05})
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "go"}]
    executor = gw.kits.workflows.service.executor
    await stage(http, gw, "wf-done", "s1", history, **{"x-workflow-complete": "true"})
    await asyncio.sleep(0.3)
    assert executor.hard_flushes.get("pod0") is None and mock_pods[0].engine.cache.cached_blocks()  # soft only
    await stage(http, gw, "wf-asks", "s1", history)
    await stage(http, gw, "wf-asks", "s2", history, **{"x-stage-cache-policy": "flush"})
    await eventually(lambda: executor.hard_flushes.get("pod0") == 1)


async def test_a_declared_retention_is_never_flushed_inside_its_ttl(start_mock_pod, start_gateway, http):
    """A workflow whose client declared prompt_cache_retention completes: its context stays resumable and
    the pod keeps its cache (the hard flush waits, saying why). A flush the client asks for itself wins."""
    mock_pods, gw = await fleet(start_mock_pod, start_gateway, n=1,
                                workflow={"flush_retry_base_s": 0.05, "flush_retries": 2, "hard_flush": True})
    cache, metrics = mock_pods[0].engine.cache, gw.kits.foundation.metrics.registry
    executor = gw.kits.workflows.service.executor

    async def stage_declaring(workflow: str, stage_id: str, retention: str | None = "24h", **headers: str) -> int:
        body = {"model": MODEL, "messages": [{"role": "system", "content": CONTEXT},
                                             {"role": "user", "content": f"{workflow} {stage_id}"}],
                "max_tokens": 8} | ({"prompt_cache_retention": retention} if retention else {})
        async with http.post(f"{gw.url}/v1/chat/completions", json=body,
                             headers={"x-workflow-id": workflow, "x-stage-id": stage_id, **headers}) as resp:
            return resp.status

    # A client that declared a retention and then asks for a flush itself gets it.
    assert await stage_declaring("wf-asks", "s1") == 200
    assert await stage_declaring("wf-asks", "s2", retention=None, **{"x-stage-cache-policy": "flush"}) == 200
    await eventually(lambda: executor.hard_flushes.get("pod0") == 1)
    async with http.post(f"{gw.url}/v1/workflows/wf-asks/complete") as resp:
        assert resp.status == 200
    await eventually(lambda: executor.hard_flushes.get("pod0") == 2)
    assert not cache.cached_blocks()
    # One that declared it and completes keeps its cache: the flush waits, and gives up.
    assert await stage_declaring("wf-r", "s1") == 200
    async with http.post(f"{gw.url}/v1/workflows/wf-r/complete") as resp:
        assert resp.status == 200
    await eventually(lambda: (metrics.get_sample_value("gateway_cache_actions_total", {
        "action": "hard_flush_deferred", "reason": "declared_retention", "pod": "pod0"}) or 0) >= 2)
    await asyncio.sleep(0.5)  # past its retries
    assert executor.hard_flushes.get("pod0") == 2 and cache.cached_blocks()
    assert gw.kits.kv.working_set.context("workflow:wf-r").retention_s == 86_400.0
    assert await stage_declaring("wf-r", "s2", retention="1w") == 400
