"""Profiles from a real Redis, engine metrics from real pods, and SLO admission under overload."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter

import msgspec
import redis.asyncio as redis

from gateway.load.slo_profiles import GpuProfile, ProfileStore, profile_key
from tests.integration.test_kv_subscriber import eventually
from tests.unit.test_load_model import PROFILE


async def test_profiles_refresh_newer_wins_and_redis_outage_is_survived(redis_server):
    client = redis.from_url(redis_server.url)
    await client.set(profile_key("m", "a100"), json.dumps(PROFILE))
    store = ProfileStore(redis_server.url, refresh_s=3600)
    store.learn_models(frozenset({"m"}))
    await store.start()
    try:
        assert store.get("m", "a100").created == 100.0
        await client.set(profile_key("m", "a100"), json.dumps(PROFILE | {"created": 50.0}))
        await client.set(profile_key("m", "h100"), json.dumps(PROFILE | {"gpu": "h100", "created": 300.0}))
        await client.set(profile_key("m", "bad"), b"{not json")
        assert await store.refresh()
        assert store.get("m", "a100").created == 100.0  # the older one did not replace it
        assert store.get("m", "h100").created == 300.0 and store.invalid == 1
        await client.aclose()
        redis_server.stop()
        assert not await store.refresh()  # Redis down: counted, profiles kept
        assert store.errors == 1 and store.get("m", "h100") is not None
        redis_server.start()
        client = redis.from_url(redis_server.url)
        await client.set(profile_key("m", "a100"), json.dumps(PROFILE | {"created": 400.0}))
        assert await store.refresh()  # back: the client reconnects by itself
        assert store.get("m", "a100").created == 400.0
    finally:
        await store.stop()
        await client.aclose()


def test_cli_loads_and_shows_profiles(redis_server, tmp_path):
    path = tmp_path / "profile_mock-llama_mock.json"
    path.write_text(json.dumps(PROFILE | {"gpu": "mock"}))
    cmd = [sys.executable, "-m", "gateway", "profiles"]
    loaded = subprocess.run([*cmd, "load", str(path), "--redis", redis_server.url], capture_output=True, text=True,
                            timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert "aibrix:profile_mock-llama_mock" in loaded.stdout
    shown = subprocess.run([*cmd, "show", "--redis", redis_server.url], capture_output=True, text=True, timeout=60)
    assert "aibrix:profile_mock-llama_mock: deployment mock" in shown.stdout and "max 10.00 req/s" in shown.stdout
    (tmp_path / "broken.json").write_text("{}")
    bad = subprocess.run([*cmd, "load", str(tmp_path / "broken.json"), "--redis", redis_server.url],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gpu" in bad.stderr


def test_shipped_mock_profile_is_valid():
    from pathlib import Path

    data = Path(__file__).resolve().parents[2].joinpath("profiles/profile_mock-llama_mock.json").read_bytes()
    profile = msgspec.json.decode(data, type=GpuProfile)
    assert profile.gpu == "mock" and max(max(r) for r in profile.tputs) > 0


async def test_gateway_uses_redis_profiles_for_pending_load(redis_server, start_mock_pod, start_gateway, http):
    client = redis.from_url(redis_server.url)
    await client.set(profile_key("mock-llama", "small"), json.dumps(PROFILE | {"gpu": "small"}))
    await client.aclose()
    pods = [await start_mock_pod(speed=0.5) for _ in range(2)]
    gw = await start_gateway([{"url": p.url, "name": f"pod{i}", "deployment": "small"} for i, p in enumerate(pods)],
                             routing={"policy": "pending_load"}, load={"redis_url": redis_server.url})
    assert gw.kits.load.profiles.get("mock-llama", "small") is not None
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "x " * 100}], "max_tokens": 200}
    tasks = [asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=body)) for _ in range(4)]
    await eventually(lambda: gw.kits.shared.ledger.total() == 4)
    loads = sorted(gw.kits.load.load.load(f"pod{i}") for i in range(2))
    assert loads[0] == loads[1] > 0  # spread by Little's-law load: 2 and 2
    for t in tasks:
        (await t).close()
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_routing_decisions_total{policy="pending_load",reason="least_pending_load"} 4.0' in metrics


async def test_admission_rejects_the_excess_with_retry_after(start_mock_pod, start_gateway, http):
    pods = [await start_mock_pod(speed=1.0) for _ in range(2)]
    gw = await start_gateway([p.url for p in pods], routing={"policy": "least_request"},
                             load={"default_capacity": 2, "scrape_interval_s": 0},
                             admission={"enabled": True},
                             flow_control={"enabled": False, "max_queued": 2, "max_wait_s": 0.2})
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "slow " * 50}], "max_tokens": 100}

    async def one():
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            return resp.status, resp.headers.get("Retry-After"), await resp.json()

    results = await asyncio.gather(*(one() for _ in range(10)))
    statuses = Counter(status for status, _, _ in results)
    assert statuses[200] >= 4 and statuses[429] >= 1 and set(statuses) <= {200, 429}
    for status, retry_after, payload in results:
        if status == 429:
            assert int(retry_after) >= 1
            assert payload["error"]["type"] == "rate_limit_error"
            assert payload["error"]["code"] in {"queue_full", "queue_timeout"}
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_flow_requests_total{fairness_id="default",outcome="at_once",priority="0"} 4.0' in metrics
    assert gw.kits.flow.flow.queued == 0 and all(gw.kits.load.load.load(p.name) == 0
                                                 for p in gw.kits.foundation.pods.all())


async def test_queued_requests_start_when_capacity_frees(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod(speed=0.2)
    gw = await start_gateway([pod.url], load={"default_capacity": 1, "scrape_interval_s": 0},
                             admission={"enabled": True}, flow_control={"enabled": False, "max_wait_s": 30})
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "q"}], "max_tokens": 20}
    results = await asyncio.gather(*(http.post(f"{gw.url}/v1/chat/completions", json=body) for _ in range(4)))
    assert [r.status for r in results] == [200] * 4
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_flow_requests_total{fairness_id="default",outcome="after_wait",priority="0"} 3.0' in metrics


async def test_bad_slo_headers_are_400(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], admission={"enabled": True})
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "q"}]}
    for headers in ({"x-slo-ttft-ms": "soon"}, {"x-slo-e2e-ms": "-5"}, {"x-priority": "high"}):
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_slo_header"


async def test_scraper_reads_engine_stats_and_marks_stale(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod(speed=1.0)
    gw = await start_gateway([{"url": pod.url, "name": "p"}], load={"scrape_interval_s": 0.05})
    stats = gw.kits.load.load.engine
    await eventually(lambda: "p" in stats and not stats["p"].stale)
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 500, "stream": True}
    resp = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    await eventually(lambda: stats["p"].running == 1 and stats["p"].kv_usage > 0)
    resp.close()
    await pod.stop()
    await eventually(lambda: stats["p"].stale)
    assert stats["p"].running == 1  # last values kept, marked stale


async def test_redis_outage_never_blocks_requests(redis_server, start_mock_pod, start_gateway, http):
    client = redis.from_url(redis_server.url)
    await client.set(profile_key("mock-llama", "small"), json.dumps(PROFILE | {"gpu": "small"}))
    await client.aclose()
    pod = await start_mock_pod()
    gw = await start_gateway([{"url": pod.url, "deployment": "small"}], routing={"policy": "pending_load"},
                             load={"redis_url": redis_server.url, "profile_refresh_s": 0.1},
                             admission={"enabled": True})
    redis_server.stop()
    store = gw.kits.load.profiles
    await eventually(lambda: store.errors >= 2)
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "still here?"}], "max_tokens": 2}
    statuses = [(await http.post(f"{gw.url}/v1/chat/completions", json=body)).status for _ in range(20)]
    assert statuses == [200] * 20 and store.get("mock-llama", "small") is not None


async def test_shutting_down_refuses_what_waits_for_capacity_and_keeps_what_runs(start_mock_pod, start_gateway,
                                                                                  http):
    pod = await start_mock_pod(speed=1.0)
    gw = await start_gateway([pod.url], routing={"policy": "least_request"},
                             load={"default_capacity": 1, "scrape_interval_s": 0},
                             admission={"enabled": True}, flow_control={"enabled": False, "max_wait_s": 60})
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "slow " * 50}], "max_tokens": 60}
    running = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=body))
    await eventually(lambda: gw.kits.shared.ledger.total() == 1)
    queued = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=body))
    await eventually(lambda: gw.kits.flow.flow.queued == 1)
    stopping = asyncio.create_task(gw.runner.cleanup())  # SIGTERM's drain
    refused = await asyncio.wait_for(queued, timeout=5)  # at once, not after its 60 s of queueing
    assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
    assert (await asyncio.wait_for(running, timeout=30)).status == 200  # what runs, finishes
    await stopping
