"""Public model names through a real gateway and simulated pods: aliases, sticky splits, fallbacks (targets
killed, saturated, failing before the first byte), and the model named right in every answer and event.

The pods serve ``stable`` (two pods), ``canary`` and ``small``; a pod refuses a model it does not serve
(404, as vLLM), so an answer at all proves the pod was sent the target.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest

from tests.conftest import chat_body, eventually

RULES = {
    "gpt-4o-mini": {"target": "stable"},
    "shown": {"target": "stable", "expose_target": True},
    "chat": {"targets": [{"model": "stable", "weight": 80}, {"model": "canary", "weight": 20}]},
    "guarded": {"target": "stable", "fallbacks": ["canary", "small"]},
}


@pytest.fixture
async def fleet(start_mock_pod, start_gateway):
    pods = {name: [await start_mock_pod(model=model) for _ in range(count)]
            for name, model, count in (("stable", "stable", 2), ("canary", "canary", 1), ("small", "small", 1))}

    async def gateway(**overrides: Any):
        overrides.setdefault("health", {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 1})
        overrides.setdefault("models", {"rules": RULES})
        return await start_gateway([p.url for group in pods.values() for p in group], **overrides)

    return pods, gateway


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/chat/completions",
               **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with http.post(url + path, json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_an_alias_is_served_by_its_target_and_answers_in_the_public_name(fleet, http):
    _, gateway = fleet
    gw = await gateway()
    status, headers, body = await post(http, gw.url, chat_body(model="gpt-4o-mini"))
    assert status == 200 and json.loads(body)["model"] == "gpt-4o-mini"
    assert headers["x-gateway-model"] == "stable"
    status, headers, body = await post(http, gw.url, chat_body(model="shown"))
    assert status == 200 and json.loads(body)["model"] == "stable"  # expose_target: the target's name
    async with http.get(f"{gw.url}/v1/models") as resp:
        cards = {c["id"]: c for c in (await resp.json())["data"]}
    assert cards["guarded"]["targets"] == ["stable", "canary", "small"] and {"stable", "chat"} <= cards.keys()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body(model="gpt-4o-mini", stream=True, stream_options={"include_usage": True},
                                       max_tokens=12)),
    ("/v1/completions", {"model": "gpt-4o-mini", "prompt": "Once upon", "max_tokens": 12, "stream": True}),
    ("/v1/messages", {"model": "gpt-4o-mini", "max_tokens": 12, "stream": True,
                      "messages": [{"role": "user", "content": "Hello"}]}),
])
async def test_every_event_of_a_stream_names_the_public_model(fleet, http, path, body):
    _, gateway = fleet
    gw = await gateway()
    status, headers, raw = await post(http, gw.url, body, path)
    assert status == 200 and headers["x-gateway-model"] == "stable"
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    models = [e.get("model") or e.get("message", {}).get("model") for e in events]
    named = [m for m in models if m is not None]
    assert named and set(named) == {"gpt-4o-mini"}
    assert b"stable" not in raw  # nowhere else either
    usage = (events[-1].get("usage") or {}) if path != "/v1/messages" else {}
    assert path != "/v1/chat/completions" or usage.get("completion_tokens") == 12


async def test_a_split_keeps_its_weights_and_never_moves_a_session(fleet, http):
    pods, gateway = fleet
    # 10,000 sessions through pods and a gateway on this one event loop: beside a CPU hog a health check took
    # longer than the fleet's 0.5 s, and one failure took a pod out (503s). No pod fails here.
    gw = await gateway(health={"interval_s": 0.2, "timeout_s": 30.0, "failure_threshold": 3})
    sessions = 10_000
    targets: dict[int, set[str]] = {s: set() for s in range(sessions)}
    limit = asyncio.Semaphore(32)

    async def turn(session: int, content: str) -> None:
        async with limit:
            status, headers, body = await post(http, gw.url, chat_body(model="chat", content=content),
                                               **{"x-session-id": f"s-{session}"})
        assert status == 200 and json.loads(body)["model"] == "chat"
        targets[session].add(headers["x-gateway-model"])

    await asyncio.gather(*(turn(s, "first turn") for s in range(sessions)))
    # A second turn of every fifth session (the unit test sends every session's: the same rules decide).
    await asyncio.gather(*(turn(s, "second turn") for s in range(0, sessions, 5)))
    assert all(len(t) == 1 for t in targets.values())  # no session changed target
    shares = Counter(next(iter(t)) for t in targets.values())
    assert abs(shares["canary"] / sessions - 0.2) <= 0.02
    served = sum(p.engine.finished_requests for p in pods["canary"])
    # The canary pod saw exactly its sessions' turns.
    assert served == shares["canary"] + sum(1 for s in range(0, sessions, 5) if targets[s] == {"canary"})


async def test_a_target_whose_pods_die_mid_run_loses_no_request(fleet, http):
    pods, gateway = fleet
    gw = await gateway()
    for pod in pods["stable"]:  # requests stay in flight there long enough to be cut
        pod.faults.stall_s = 0.3
    statuses: list[int] = []
    served_by: Counter[str] = Counter()

    async def client(n: int) -> None:
        for i in range(6):
            status, headers, _ = await post(http, gw.url, chat_body(model="guarded", content=f"client {n} turn {i}"))
            statuses.append(status)
            served_by[headers.get("x-gateway-model", "-")] += 1

    clients = asyncio.gather(*(client(n) for n in range(8)))
    await eventually(lambda: served_by["stable"] >= 8)  # running, and more in flight there
    for pod in pods["stable"]:
        await pod.kill()
    await clients
    assert statuses == [200] * 48  # none lost: those cut on a dying pod went to the fallback
    assert served_by["stable"] and served_by["canary"] and served_by["stable"] + served_by["canary"] == 48
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_model_fallbacks_total{cause="failed",model="guarded",target="stable"}' in metrics \
        or 'gateway_model_fallbacks_total{cause="no_pod",model="guarded",target="stable"}' in metrics


async def test_a_saturated_target_hands_its_requests_to_the_fallback_at_once(fleet, http):
    pods, gateway = fleet
    gw = await gateway(flow_control={"saturation": {"in_flight": 1}})
    for pod in pods["stable"]:
        pod.faults.stall_s = 1.0
    busy = [asyncio.create_task(post(http, gw.url, chat_body(model="stable", content=f"long {i}"))) for i in range(2)]
    await asyncio.sleep(0.2)  # both stable pods hold one request: saturated
    started = asyncio.get_running_loop().time()
    status, headers, body = await post(http, gw.url, chat_body(model="guarded"))
    assert status == 200 and headers["x-gateway-model"] == "canary" and json.loads(body)["model"] == "guarded"
    assert asyncio.get_running_loop().time() - started < 0.9  # it did not wait for the stable pods
    assert [r[0] for r in await asyncio.gather(*busy)] == [200, 200]
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_model_fallbacks_total{cause="saturated",model="guarded",target="stable"} 1.0' in metrics


async def test_targets_failing_before_the_first_byte_fall_back_in_order(fleet, http):
    pods, gateway = fleet
    gw = await gateway()
    for pod in [*pods["stable"], *pods["canary"]]:
        pod.faults.error_fraction = 1.0
    results = await asyncio.gather(*(post(http, gw.url, chat_body(model="guarded", content=f"q{i}"))
                                     for i in range(10)))
    assert [r[0] for r in results] == [200] * 10
    assert {r[1]["x-gateway-model"] for r in results} == {"small"}
    assert all(json.loads(r[2])["model"] == "guarded" for r in results)
    for pod in pods["stable"]:
        pod.faults.error_fraction = 0.0
    # Without a fallback left, the last target's failure is the client's answer.
    for pod in pods["small"]:
        pod.faults.error_fraction = 1.0
    status, _, body = await post(http, gw.url, chat_body(model="small"))
    assert status == 502 and json.loads(body)["error"]["code"] == "bad_gateway"


async def test_a_ttft_slo_counts_the_wait_at_every_target_it_fell_back_from(fleet, http):
    # Every pod is busy: the request waits fallback_wait_s at stable, then at canary, then small. Its TTFT
    # target (1 s) bounds its whole wait at the gateway, not each target's.
    pods, gateway = fleet
    rules = {"guarded": {"target": "stable", "fallbacks": ["canary", "small"], "fallback_wait_s": 1.0}}
    gw = await gateway(models={"rules": rules}, flow_control={"saturation": {"in_flight": 1}})
    for group in pods.values():
        for pod in group:
            pod.faults.stall_s = 4.0
    busy = [asyncio.create_task(post(http, gw.url, chat_body(model=model, content=f"long {i}")))
            for model, count in (("stable", 2), ("canary", 1), ("small", 1)) for i in range(count)]
    try:
        await asyncio.sleep(0.3)  # every pod holds one request: saturated
        started = asyncio.get_running_loop().time()
        status, _, body = await post(http, gw.url, chat_body(model="guarded"), **{"x-slo-ttft-ms": "1000"})
        waited = asyncio.get_running_loop().time() - started
        assert status == 429 and json.loads(body)["error"]["code"] == "queue_timeout"
        assert waited < 2.0, waited  # not 1 s at each of three targets
    finally:
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)


@pytest.mark.parametrize("store", ["gateway", "pods"])
async def test_a_split_keeps_a_responses_conversation_on_the_target_of_its_first_turn(start_mock_pod, start_gateway,
                                                                                      http, store):
    """Turns chained by ``previous_response_id`` alone (no session, no ``conversation``): the first is drawn
    by the weights, and every later turn gets the target that answered it, whoever keeps the responses."""
    pods = [await start_mock_pod(model=model, responses_store=True) for model in ("stable", "canary")]
    gw = await start_gateway([p.url for p in pods], models={"rules": RULES}, responses={"store": store})
    targets: list[list[str]] = []
    for n in range(30):
        previous, seen = None, []
        for turn in range(3):
            body = {"model": "chat", "input": f"conversation {n}, turn {turn}", "max_output_tokens": 2}
            if previous is not None:
                body["previous_response_id"] = previous
            status, headers, raw = await post(http, gw.url, body, "/v1/responses")
            assert status == 200, raw
            previous = json.loads(raw)["id"]
            seen.append(headers["x-gateway-model"])
        targets.append(seen)
    assert all(len(set(seen)) == 1 for seen in targets), targets


async def test_models_lists_what_a_healthy_pod_can_serve_now(fleet, http):
    """A model whose pods are all down leaves /v1/models, and a public name with it when none of its
    targets is left; the names with a target still served stay."""
    pods, gateway = fleet
    gw = await gateway()

    async def listed() -> set[str]:
        async with http.get(f"{gw.url}/v1/models") as resp:
            return {c["id"] for c in (await resp.json())["data"]}

    assert await listed() == {"stable", "canary", "small", *RULES}
    for pod in pods["stable"]:
        await pod.stop()
    await eventually(lambda: not any(p.healthy for p in gw.kits.foundation.pods.all() if p.serves("stable")))
    assert await listed() == {"canary", "small", "chat", "guarded"}  # each still has a target served
    await pods["canary"][0].stop()
    await eventually(lambda: not any(p.healthy for p in gw.kits.foundation.pods.all() if p.serves("canary")))
    assert await listed() == {"small", "guarded"}
