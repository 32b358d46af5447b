"""API keys' token and concurrency limits through real gateways: refused in the route's shape with a
Retry-After, held together by 2 replicas of 2 workers each (Unix datagrams between workers, Redis between
replicas), each replica keeping to its share when Redis is lost; and usage per key, tenant and model."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.cluster.identity import WorkerIdentity
from gateway.config import hash_api_key
from gateway.flow.release_order import SharedReleaseOrder
from gateway.load.shared_table import SharedLoadTable
from tests.conftest import eventually

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}
AUTH = {"keys": [{"hash": hash_api_key(secret), "name": name} for name, secret in KEYS.items()]}
FAST_BUS = {"flush_ms": 1.0, "heartbeat_s": 0.2, "peer_timeout_s": 1.0, "redis_timeout_s": 0.3}
PROMPT = "Summarise the incident report for the on-call engineer. " * 12  # about 140 tokens


def sliding_minute(tokens: int, sent_at: float, read_at: float) -> tuple[float, float]:
    """The least and most the limiter's sliding minute holds of ``tokens`` charged after ``sent_at`` (wall clock),
    read at ``read_at``: all of them within one minute; past a minute's turn, at least the part of the previous
    minute still inside the last 60 seconds (a CI run crossed one and read 240 of 242)."""
    if sent_at // 60 == read_at // 60:
        return tokens, tokens
    return tokens * (1 - (read_at % 60) / 60), tokens


def bearer(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def chat(content: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": "mock-llama", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


@pytest.fixture
def run_dirs() -> Iterator[list[str]]:
    paths = [tempfile.mkdtemp(prefix="gw-", dir="/tmp") for _ in range(2)]
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def workers(replica: str, run_dir: str) -> list[WorkerIdentity]:
    SharedLoadTable.create(WorkerIdentity(replica, 0, 2, run_dir).load_table, 2).close()
    SharedReleaseOrder.create(WorkerIdentity(replica, 0, 2, run_dir).release_order, 2).close()
    return [WorkerIdentity(replica, i, 2, run_dir) for i in range(2)]


def minute_to_spare(seconds: float = 12.0) -> float:
    """Seconds to wait so that a burst of ``seconds`` stays inside one wall-clock minute (the window slides
    from the next one on)."""
    into = time.time() % 60
    return 60.5 - into if into > 60 - seconds else 0.0


def sliding(limit: float, started: float) -> float:
    """What a minute's limit lets through by now of a burst that began at ``started``: all of it within that
    wall-clock minute; past its end the burst's minute weighs only its part still inside the sliding window,
    so more fits (a loaded machine can stretch the burst past the minute it was given)."""
    now = time.time()
    if int(now // 60) == int(started // 60):
        return limit
    return limit / (1 - (now % 60) / 60)


async def flood(http, gateways, key: str, until_refused_s: float = 2.5) -> tuple[int, int]:
    """Requests from 16 clients spread over ``gateways`` until every client was refused for a while (longer
    than a charge may stay unconfirmed: a limit nearly reached lets requests in again by then): (prompt tokens
    served, as the engine counted them; requests refused)."""
    served, refused = 0, 0

    async def client(n: int) -> None:
        nonlocal served, refused
        gw, last_ok, i = gateways[n % len(gateways)], time.monotonic(), 0
        while time.monotonic() - last_ok < until_refused_s:
            async with http.post(f"{gw.url}/v1/chat/completions", json=chat(f"{n}-{i} {PROMPT}"),
                                 headers=bearer(key)) as resp:
                body = await resp.json()
                if resp.status == 200:
                    served += body["usage"]["prompt_tokens"]
                    last_ok = time.monotonic()
                else:
                    assert resp.status == 429 and body["error"]["code"] == "token_limit_exceeded"
                    assert int(resp.headers["retry-after"]) >= 1
                    refused += 1
                    await asyncio.sleep(0.02)
            i += 1

    await asyncio.gather(*(client(n) for n in range(16)))
    return served, refused


async def test_limits_refuse_in_the_routes_shape_and_usage_is_counted(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], auth=AUTH, flow_control={"keys": {"alice": "team", "bob": "team"}},
                             limits={"keys": {"alice": {"input_tokens_per_minute": 300}},
                                     "tenants": {"team": {"max_concurrent": 1}}})
    sent_at = time.time()
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat(), headers=bearer("alice")) as resp:
        assert resp.status == 200
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat(), headers=bearer("alice")) as resp:
        body = await resp.json()
        assert resp.status == 429 and body["error"]["code"] == "token_limit_exceeded"
        assert 1 <= int(resp.headers["retry-after"]) <= 120  # the rest of this minute, and part of the next
        assert "300 input tokens per minute" in body["error"]["message"]
    anthropic = {"model": "mock-llama", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]}
    async with http.post(f"{gw.url}/v1/messages", json=anthropic, headers=bearer("alice")) as resp:
        body = await resp.json()
        assert resp.status == 429 and body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "retry-after" in resp.headers
    # The tenant's one request at a time: bob waits on a slow answer, then another of the team is refused.
    pod.faults.stall_s = 0.5
    slow = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=chat("slow"), headers=bearer("bob")))
    await asyncio.sleep(0.2)
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat("x"), headers=bearer("bob")) as resp:
        assert resp.status == 429 and (await resp.json())["error"]["code"] == "concurrency_limit_exceeded"
    assert (await slow).status == 200
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat("y"), headers=bearer("carol")) as resp:
        assert resp.status == 200  # carol is her own tenant, without limits
    usage = await (await http.get(f"{gw.url}/debug/usage")).json()
    read_at = time.time()
    rows = {(r["key"], r["tenant"]): r for r in usage["usage"]}
    assert rows[("alice", "team")]["requests"] == 1 and rows[("bob", "team")]["requests"] == 1
    assert rows[("alice", "team")]["input_tokens"] > 100 and rows[("carol", "carol")]["output_tokens"] == 4
    least, most = sliding_minute(rows[("alice", "team")]["input_tokens"], sent_at, read_at)
    assert least - 0.5 <= usage["limited"]["key:alice"]["input_tokens_minute"] <= most
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_usage_tokens_total{key="carol",kind="output",model="mock-llama",tenant="carol"} 4.0' in metrics


async def test_two_replicas_of_two_workers_serve_a_minutes_tokens_within_5_percent(
        start_mock_pod, start_gateway, http, redis_server, run_dirs):
    pods = [(await start_mock_pod()).url for _ in range(2)]
    limit = 30_000
    config = {"auth": AUTH, "limits": {"keys": {"alice": {"input_tokens_per_minute": limit},
                                                "bob": {"input_tokens_per_minute": limit}}},
              "shared_state": {**FAST_BUS, "redis_url": redis_server.url}}
    identities = workers("ra", run_dirs[0]) + workers("rb", run_dirs[1])
    gateways = [await start_gateway(pods, identity=identity, **config) for identity in identities]
    await eventually(lambda: all(len(g.kits.shared.bus.peers) == 3 for g in gateways), within_s=10)
    await asyncio.sleep(minute_to_spare())
    started = time.time()
    served, refused = await flood(http, gateways, "alice")
    allowed = sliding(limit, started)
    assert refused and abs(served - allowed) / allowed <= 0.05, (served, allowed)

    # Redis lost: each replica keeps to half of bob's limit on its own; together, the limit again.
    redis_server.stop()
    await eventually(lambda: all(g.kits.shared.bus.redis_up is False for g in gateways), within_s=10)
    assert all(g.kits.limits.limits.usage.share() == 0.5 for g in gateways)
    await asyncio.sleep(minute_to_spare())
    for r in range(2):
        started = time.time()
        served = (await flood(http, gateways[r * 2:r * 2 + 2], "bob"))[0]
        allowed = sliding(limit, started) / 2
        assert abs(served - allowed) / allowed <= 0.05, (r, served, allowed)


async def test_a_client_that_leaves_mid_stream_is_charged_what_it_was_streamed(start_mock_pod, start_gateway, http):
    """An agent's user presses Esc: the tokens the pod generated until then count, to its usage and to its
    key's limits, as for a stream that ended."""
    pod = await start_mock_pod(speed=1.0)
    gw = await start_gateway([pod.url], auth=AUTH, limits={"keys": {"alice": {"output_tokens_per_minute": 10**6}}})
    resp = await http.post(f"{gw.url}/v1/chat/completions", json=chat(max_tokens=2000, stream=True),
                           headers=bearer("alice"))
    received = b""
    while received.count(b"data: ") < 8:
        received += await resp.content.readany()
    resp.close()  # the client hangs up mid-stream
    await eventually(lambda: bool(gw.kits.limits.tally.debug()), within_s=5)  # the request completed
    usage = await (await http.get(f"{gw.url}/debug/usage")).json()
    rows = {r["key"]: r for r in usage["usage"]}
    assert rows["alice"]["requests"] == 1 and rows["alice"]["input_tokens"] > 100
    assert 5 <= rows["alice"]["output_tokens"] < 2000
    assert 5 <= usage["limited"]["key:alice"]["output_tokens_minute"] < 2000  # what was streamed, not max_tokens
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert any(line.startswith("gateway_stream_aborts_total{") and 'side="client"' in line and line.endswith(" 1.0")
               for line in metrics.splitlines())  # counted as the client's abort
