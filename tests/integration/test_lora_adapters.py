"""LoRA adapters on demand through a real gateway and simulated pods that serve them as vLLM 0.32 does
(registration endpoints, one batch slot each, adapter-namespaced KV): registered where first needed, kept
there, spilled to a pod with room when theirs is saturated, registered once however many ask at once,
retried elsewhere when a pod refuses, and unregistered once idle."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp

from tests.conftest import eventually

ADAPTERS = {name: {"path": f"/adapters/{name}", "base_model": "mock-llama"} for name in ("sql", "poem", "code")}
SYSTEM = {name: f"You are the {name} adapter. " + " ".join(f"{name}-rule-{i}" for i in range(150))
          for name in ADAPTERS}


def body(adapter: str, question: str, **extra: Any) -> dict[str, Any]:
    return {"model": adapter, "max_tokens": 4, **extra,
            "messages": [{"role": "system", "content": SYSTEM[adapter]}, {"role": "user", "content": question}]}


async def post(http: aiohttp.ClientSession, gw: Any, adapter: str, question: str) -> tuple[int, dict, dict]:
    async with http.post(f"{gw.url}/v1/chat/completions", json=body(adapter, question)) as resp:
        return resp.status, dict(resp.headers), json.loads(await resp.read())


async def lora_fleet(start_mock_pod, start_gateway, n: int = 2, policy: str = "kv_aware", **overrides: Any):
    pods = [await start_mock_pod(enable_lora=True, max_loras=1) for _ in range(n)]
    overrides.setdefault("models", {"adapters": ADAPTERS})
    gw = await start_gateway([p.url for p in pods], routing={"policy": policy}, **overrides)
    return pods, gw


async def test_each_adapter_is_registered_where_needed_and_its_requests_stay_there(start_mock_pod, start_gateway,
                                                                                    http):
    pods, gw = await lora_fleet(start_mock_pod, start_gateway)
    assert all(not p.adapters for p in pods)  # none registered at start
    served: dict[str, Counter[str]] = {"sql": Counter(), "poem": Counter()}
    cached: dict[str, list[int]] = {"sql": [], "poem": []}
    for turn in range(6):
        for adapter in ("sql", "poem"):
            status, headers, answer = await post(http, gw, adapter, f"question {turn % 2}")
            assert status == 200 and answer["model"] == adapter
            served[adapter][headers["x-gateway-pod"]] += 1
            cached[adapter].append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    home = {adapter: next(iter(counts)) for adapter, counts in served.items()}
    assert all(len(counts) == 1 for counts in served.values())  # each adapter's requests on one pod
    assert home["sql"] != home["poem"]  # one batch slot each: the two adapters on two pods, never switching
    by_url = {p.url.split("://")[1]: p for p in pods}
    for adapter, pod in home.items():
        assert set(by_url[pod].adapters) == {adapter}  # registered there, and only there
    assert all(p.engine.lora.activations == 1 for p in pods)
    # The repeated prompt found its prefix cached on its adapter's pod (the system prompt from turn one on).
    assert all(c[0] == 0 and min(c[1:]) > 300 for c in cached.values())
    debug = await (await http.get(f"{gw.url}/debug/adapters")).json()
    assert {name: p["listed"] for name, p in debug["pods"].items()} == {home["sql"]: ["sql"], home["poem"]: ["poem"]}
    assert all(p["registrations"] == {"loaded": 1} for p in debug["pods"].values())
    models = await (await http.get(f"{gw.url}/v1/models")).json()
    assert {"sql", "poem", "code"} <= {c["id"] for c in models["data"]}  # code: registered when first asked


async def test_a_saturated_home_spills_the_adapter_to_a_pod_with_room(start_mock_pod, start_gateway, http):
    pods, gw = await lora_fleet(start_mock_pod, start_gateway, flow_control={"saturation": {"in_flight": 1}})
    status, headers, _ = await post(http, gw, "sql", "first")
    home = headers["x-gateway-pod"]
    for pod in pods:
        pod.faults.stall_s = 0.5
    long = asyncio.create_task(post(http, gw, "sql", "long one"))
    await asyncio.sleep(0.2)  # the home pod holds it: saturated, and the other has room
    status, headers, _ = await post(http, gw, "sql", "another")
    assert status == 200 and headers["x-gateway-pod"] != home
    assert (await long)[0] == 200
    assert all("sql" in p.adapters for p in pods)


async def test_many_requests_for_a_new_adapter_register_it_once(start_mock_pod, start_gateway, http):
    pods, gw = await lora_fleet(start_mock_pod, start_gateway, n=1)
    pods[0].engine.timing = pods[0].engine.timing.__class__(speed=0.2)  # a registration that takes a while
    results = await asyncio.gather(*(post(http, gw, "code", f"q{i}") for i in range(10)))
    assert [r[0] for r in results] == [200] * 10
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    registered = [line for line in metrics.splitlines() if line.startswith("gateway_lora_registrations_total{")]
    assert len(registered) == 1 and registered[0].endswith(" 1.0") and 'outcome="loaded"' in registered[0]


async def test_a_pod_that_cannot_register_sends_the_request_to_one_that_can(start_mock_pod, start_gateway, http):
    refusing = await start_mock_pod()  # no --enable-lora: vLLM has no registration endpoint then
    able = await start_mock_pod(enable_lora=True)
    gw = await start_gateway([refusing.url, able.url], routing={"policy": "round_robin"},
                             models={"adapters": ADAPTERS})
    results = [await post(http, gw, "poem", f"q{i}") for i in range(4)]
    assert [r[0] for r in results] == [200] * 4
    assert {r[1]["x-gateway-pod"] for r in results} == {able.url.split("://")[1]}
    assert "poem" in able.adapters and not refusing.adapters


async def test_an_adapter_a_pod_stopped_serving_is_unregistered_there(start_mock_pod, start_gateway, http):
    pods, gw = await lora_fleet(start_mock_pod, start_gateway, n=1,
                                models={"adapters": ADAPTERS, "lora": {"idle_unload_s": 0.3}})
    for i in range(10):  # served every 0.1 s: it stays
        assert (await post(http, gw, "sql", f"q{i}"))[0] == 200
        await asyncio.sleep(0.1)
        assert "sql" in pods[0].adapters
    await eventually(lambda: not pods[0].adapters, within_s=3)  # idle: unregistered
    assert not gw.kits.foundation.pods.all()[0].serves("sql")
    status, _, _ = await post(http, gw, "sql", "again")  # registered again when needed
    assert status == 200 and "sql" in pods[0].adapters
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_lora_unregistrations_total{adapter="sql",outcome="unloaded",pod=' in metrics


async def test_an_adapter_idles_from_the_end_of_its_last_request_not_its_start(start_mock_pod, start_gateway, http):
    pods, gw = await lora_fleet(start_mock_pod, start_gateway, n=1,
                                models={"adapters": ADAPTERS, "lora": {"idle_unload_s": 0.6}})
    pods[0].faults.stall_s = 1.0  # the request runs longer than the adapter may idle
    assert (await post(http, gw, "sql", "a long one"))[0] == 200
    await asyncio.sleep(0.3)  # idle 0.3 s since the request ended, 1.3 s since it began
    assert "sql" in pods[0].adapters
    await eventually(lambda: not pods[0].adapters, within_s=3)  # then idle long enough: unregistered


async def test_an_adapter_the_engine_runs_stays_whoever_sent_its_request(start_mock_pod, start_gateway, http):
    pods, gw = await lora_fleet(start_mock_pod, start_gateway, n=1, load={"scrape_interval_s": 0.1},
                                models={"adapters": ADAPTERS, "lora": {"idle_unload_s": 0.5}})
    assert (await post(http, gw, "sql", "first"))[0] == 200  # registered by the gateway
    pods[0].engine.timing = pods[0].engine.timing.__class__(speed=1.0)
    # A request this gateway did not send (another replica's, a client's straight to the pod) runs the adapter
    # for longer than it may idle: the engine's metrics say it runs.
    long = body("sql", "long", max_tokens=400, stream=True)
    async with http.post(f"{pods[0].url}/v1/chat/completions", json=long) as resp:
        assert resp.status == 200
        await asyncio.sleep(1.2)
        assert "sql" in pods[0].adapters
        await resp.read()
    await eventually(lambda: not pods[0].adapters, within_s=3)  # idle once it ends: unregistered

