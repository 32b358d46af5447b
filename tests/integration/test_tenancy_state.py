"""Tenancy of what the gateway keeps (issue 54, items 2, 3 and 6), proved adversarially: two keys of two
tenants against 2 replicas of 2 workers sharing a real Redis (and, where state is each worker's own, 2
workers without it). One test per guarantee: a key runs as its own tenant within its own bands; another key's
workflow is not found and not joined; a key's flush reaches only its own blocks (a pod-wide one needs the
admin key); a client cannot choose a response's id nor take another key's over; the response store is
bounded per key and in all, in memory and in Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from gateway.config import hash_api_key
from tests.conftest import eventually
from tests.integration.test_key_limits import FAST_BUS, run_dirs, workers  # noqa: F401 (run_dirs: a fixture)
from tests.integration.test_responses_api import sockets  # noqa: F401 (a fixture)
from tests.integration.test_responses_api import workers as sibling_workers
from tests.integration.test_shared_state import CONTEXT, MODEL

SECRETS = {"alice": "sk-alice", "bob": "sk-bob", "platform": "sk-platform", "admin": "sk-admin"}
KEYS = [{"hash": hash_api_key(SECRETS["alice"]), "name": "alice"},
        {"hash": hash_api_key(SECRETS["bob"]), "name": "bob"}]
AUTH = {"keys": KEYS, "admin_key_hashes": [hash_api_key(SECRETS["admin"])]}
TENANTS = {"keys": {"alice": "team-a", "bob": "team-b"}}
FLUSHES = {"flush_retry_base_s": 0.05, "flush_retries": 2}


def key(name: str, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {SECRETS[name]}", **headers}


async def replicas(start_mock_pod, start_gateway, redis_server, run_dirs, n_pods: int = 1,  # noqa: F811
                   **config: Any) -> tuple[list[Any], list[Any]]:
    """Simulated pods, and 2 replicas of 2 workers each sharing Redis in front of them, each hearing the others."""
    pods = [await start_mock_pod(num_blocks=400) for _ in range(n_pods)]
    pod_configs = [msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"} for i, p in enumerate(pods)]
    config.setdefault("auth", AUTH)
    config.setdefault("flow_control", TENANTS)
    shared = {"shared_state": {**FAST_BUS, "redis_url": redis_server.url}}
    identities = workers("ra", run_dirs[0]) + workers("rb", run_dirs[1])
    gateways = [await start_gateway(pod_configs, identity=identity, **shared, **config) for identity in identities]
    await eventually(lambda: all(len(g.kits.shared.bus.peers) == 3 for g in gateways), within_s=10)
    return pods, gateways


def total(gateways: list[Any], name: str, labels: dict[str, str]) -> float:
    return sum(g.kits.foundation.metrics.registry.get_sample_value(name, labels) or 0.0 for g in gateways)


async def chat(http, gw, who: str, content: str = "Hello", **headers: str) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=key(who, **headers)) as resp:
        return resp.status, await resp.json()


async def respond(http, gw, who: str, **body: Any) -> tuple[int, dict]:
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 3, **body}
    async with http.post(f"{gw.url}/v1/responses", json=body, headers=key(who)) as resp:
        return resp.status, await resp.json()


async def status_of(http, method: str, url: str, who: str) -> int:
    async with http.request(method, url, headers=key(who)) as resp:
        return resp.status


async def test_a_key_runs_as_its_tenant_within_its_bands_whatever_its_headers_say(
        start_mock_pod, start_gateway, http, redis_server, run_dirs):  # noqa: F811
    platform = {"hash": hash_api_key(SECRETS["platform"]), "name": "platform", "tenant": "team-p",
                "may_set_fairness_id": True, "max_priority": 5, "may_set_cache_actions": False}
    _, gateways = await replicas(start_mock_pod, start_gateway, redis_server, run_dirs,
                                 auth={**AUTH, "keys": [*KEYS, platform]},
                                 flow_control={**TENANTS, "objectives": {"urgent": {"priority": 50},
                                                                         "background": {"priority": -3},
                                                                         "elevated": {"priority": 5}}})
    asks = [{"x-gateway-inference-fairness-id": "team-a"}, {"x-priority": "1000"},
            {"x-gateway-inference-objective": "urgent"}]
    for headers in asks:
        for gw in gateways:
            status, body = await chat(http, gw, "bob", **headers)
            assert status == 403 and body["error"]["code"] == "identity_not_allowed", body
            assert body["error"]["param"] == next(iter(headers))
        assert total(gateways, "gateway_identity_refused_total", {"header": next(iter(headers))}) == 4
    # What asks for no more than the key's own goes on as sent; a key allowed to name a tenant may.
    for headers in ({}, {"x-gateway-inference-fairness-id": "team-b", "x-priority": "0"}, {"x-priority": "-3"}):
        assert (await chat(http, gateways[3], "bob", **headers))[0] == 200
    assert (await chat(http, gateways[1], "platform", **{"x-gateway-inference-fairness-id": "team-a",
                                                          "x-priority": "5"}))[0] == 200
    assert (await chat(http, gateways[2], "platform", **{"x-priority": "6"}))[0] == 403
    for header, value in (("x-stage-cache-policy", "flush"), ("x-stage-preserve-threshold", "9")):
        status, body = await chat(http, gateways[0], "platform", **{"x-workflow-id": "wf-p", header: value})
        assert status == 403 and body["error"]["param"] == header
    assert (await chat(http, gateways[0], "platform", **{"x-stage-cache-policy": "auto"}))[0] == 200
    flows = "gateway_flow_requests_total"
    assert total(gateways, flows, {"fairness_id": "team-b", "priority": "0", "outcome": "at_once"}) == 2
    assert total(gateways, flows, {"fairness_id": "team-b", "priority": "-3", "outcome": "at_once"}) == 1
    assert total(gateways, flows, {"fairness_id": "team-b", "priority": "1000", "outcome": "at_once"}) == 0
    assert total(gateways, flows, {"fairness_id": "team-a", "priority": "5", "outcome": "at_once"}) == 1  # platform's
    assert total(gateways, flows, {"fairness_id": "team-a", "priority": "0", "outcome": "at_once"}) == 0


async def test_another_keys_workflow_is_not_found_not_completed_and_not_joined(
        start_mock_pod, start_gateway, http, redis_server, run_dirs):  # noqa: F811
    _, gateways = await replicas(start_mock_pod, start_gateway, redis_server, run_dirs, n_pods=2)
    for stage, gw in (("s1", gateways[0]), ("s2", gateways[3])):
        assert (await chat(http, gw, "alice", CONTEXT, **{"x-workflow-id": "wf", "x-stage-id": stage}))[0] == 200

    def known(gw) -> bool:
        tracked = gw.kits.workflows.service.tracker.workflows.items()
        return any(w.rpartition("/")[2] == "wf" and len(wf.stages) == 2 for w, wf in tracked)

    await eventually(lambda: all(known(g) for g in gateways), within_s=10)
    for gw in gateways:
        assert await status_of(http, "GET", f"{gw.url}/v1/workflows/wf", "bob") == 404
        assert await status_of(http, "POST", f"{gw.url}/v1/workflows/wf/complete", "bob") == 404
    # Bob naming the same id runs a workflow of his own, and completing it leaves Alice's running.
    assert (await chat(http, gateways[1], "bob", **{"x-workflow-id": "wf", "x-stage-id": "s9",
                                                    "x-workflow-complete": "true"}))[0] == 200
    await asyncio.sleep(0.3)  # time for any change to reach every process
    for gw in gateways:
        async with http.get(f"{gw.url}/v1/workflows/wf", headers=key("alice")) as resp:
            state = await resp.json()
            assert resp.status == 200 and [s["stage_id"] for s in state["stages"]] == ["s1", "s2"], state
            assert state["workflow_id"] == "wf" and state["complete_requested"] is False


async def test_a_keys_flush_reaches_only_its_own_blocks_and_a_pod_wide_one_needs_the_admin_key(
        start_mock_pod, start_gateway, http, redis_server, run_dirs):  # noqa: F811
    pods, gateways = await replicas(start_mock_pod, start_gateway, redis_server, run_dirs, workflow=FLUSHES)
    cache = pods[0].engine.cache
    # The admin key's own workflow may empty the pod (engines flush nothing finer; no one else's is there yet).
    for stage, policy in (("s1", "auto"), ("s2", "flush")):
        headers = {"x-workflow-id": "wf-admin", "x-stage-id": stage, "x-stage-cache-policy": policy}
        assert (await chat(http, gateways[3], "admin", CONTEXT, **headers))[0] == 200
    await eventually(lambda: gateways[3].kits.workflows.service.executor.hard_flushes.get("pod0") == 1, within_s=10)
    assert not cache.cached_blocks()
    async with http.post(f"{gateways[3].url}/v1/workflows/wf-admin/complete", headers=key("admin")) as resp:
        assert resp.status == 200  # nothing of it left on the pod for a flush to wait for
    status, first = await chat(http, gateways[0], "alice", CONTEXT)
    assert status == 200 and cache.cached_blocks()
    for stage, policy in (("s1", "auto"), ("s2", "flush")):  # Bob's own workflow asks for a flush on that pod
        headers = {"x-workflow-id": "wf-b", "x-stage-id": stage, "x-stage-cache-policy": policy}
        assert (await chat(http, gateways[2], "bob", f"Bob's notes. {CONTEXT}", **headers))[0] == 200
    refused = {"action": "hard_flush_not_allowed", "reason": "override", "pod": "pod0"}
    bobs = gateways[2].kits.workflows.service.executor

    def decided() -> bool:  # refused a hard flush, or (as before keys held tenancy) did one
        return total(gateways, "gateway_cache_actions_total", refused) == 1 or bool(bobs.hard_flushes)

    await eventually(decided, within_s=10)
    await asyncio.sleep(0.5)  # a hard flush would be done by now (its retries start at 0.05 s)
    assert [g.kits.workflows.service.executor.hard_flushes.get("pod0") for g in gateways] == [None] * 3 + [1]
    status, again = await chat(http, gateways[1], "alice", CONTEXT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16


async def test_a_client_cannot_choose_a_response_id_nor_take_another_keys_over_across_replicas(
        start_mock_pod, start_gateway, http, redis_server, run_dirs):  # noqa: F811
    _, gateways = await replicas(start_mock_pod, start_gateway, redis_server, run_dirs)
    status, mine = await respond(http, gateways[0], "alice", request_id="resp_alice_chose_this")
    assert status == 200 and mine["id"] != "resp_alice_chose_this" and mine["id"].startswith("resp_")
    status, theirs = await respond(http, gateways[3], "bob", input="Take it over", request_id=mine["id"])
    assert status == 200 and theirs["id"] != mine["id"]
    url = f"{gateways[1].url}/v1/responses/{mine['id']}"
    for method, path in (("GET", ""), ("GET", "/input_items"), ("POST", "/cancel"), ("DELETE", "")):
        assert await status_of(http, method, url + path, "bob") == 404, (method, path)
    assert (await respond(http, gateways[2], "bob", previous_response_id=mine["id"]))[0] == 404
    for gw in gateways:
        async with http.get(f"{gw.url}/v1/responses/{mine['id']}", headers=key("alice")) as resp:
            assert resp.status == 200 and (await resp.json())["output"] == mine["output"]
    assert (await respond(http, gateways[3], "alice", input="Go on", previous_response_id=mine["id"]))[0] == 200


async def test_response_ids_are_the_gateways_and_unique_across_workers_without_redis(
        start_mock_pod, start_gateway, http, sockets):  # noqa: F811
    gateways = await sibling_workers(start_mock_pod, start_gateway, sockets, auth=AUTH, flow_control=TENANTS)
    status, mine = await respond(http, gateways[0], "alice")
    assert status == 200
    for gw in gateways:  # bob asks each worker for alice's id: neither keeps his answer under it
        status, theirs = await respond(http, gw, "bob", input="Take it over", request_id=mine["id"])
        assert status == 200 and theirs["id"] != mine["id"]
    assert sum(len(g.kits.responses.own) for g in gateways) == 3
    for gw in gateways:
        async with http.get(f"{gw.url}/v1/responses/{mine['id']}", headers=key("alice")) as resp:
            assert resp.status == 200 and (await resp.json())["output"] == mine["output"]


@pytest.mark.parametrize("shared", ["memory", "redis"])
async def test_the_response_store_keeps_bounds_per_key_and_in_all(start_mock_pod, start_gateway, http,
                                                                 redis_server, run_dirs, shared):  # noqa: F811
    bounds = {"max_responses": 20, "max_responses_per_key": 10}
    if shared == "redis":
        _, gateways = await replicas(start_mock_pod, start_gateway, redis_server, run_dirs, responses=bounds)
    else:
        pod = await start_mock_pod()
        gateways = [await start_gateway([pod.url], auth=AUTH, flow_control=TENANTS, responses=bounds)]
    alices = [(await respond(http, gateways[i % len(gateways)], "alice", input=f"A{i}"))[1]["id"] for i in range(5)]
    bobs = [(await respond(http, gateways[i % len(gateways)], "bob", input=f"B{i}"))[1]["id"] for i in range(25)]
    kept = {}
    for who, ids in (("alice", alices), ("bob", bobs)):
        kept[who] = [await status_of(http, "GET", f"{gateways[-1].url}/v1/responses/{i}", who) == 200 for i in ids]
    assert kept["alice"] == [True] * 5  # bob's flood evicts none of alice's
    assert kept["bob"] == [False] * 15 + [True] * 10  # his own newest 10
    if shared == "redis":
        import redis.asyncio as redis

        client = redis.from_url(redis_server.url)
        records = [k async for k in client.scan_iter(match="gateway:response:resp_*")]
        await client.aclose()
        assert len(records) == 15
