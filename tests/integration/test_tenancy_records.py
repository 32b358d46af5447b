"""Records no client can bloat (issue 54, item 4): 1,000 requests with random model names and random headers
(fairness id, priority, objective, workflow, stage and session ids, request ids, API keys) leave ``/metrics``
of a real gateway process small, with no label value over 256 characters; on a gateway of two workers with
the keys of two tenants, and on one without keys, where anyone may send anything. A request's spans carry
no attribute over 256 characters either."""

from __future__ import annotations

import asyncio
import json
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app, build_gateway
from gateway.config import hash_api_key, load_config
from tests.conftest import GatewayProcess, gateway_process, serve_app

REQUESTS = 1000
MAX_METRICS_BYTES = 200_000
MAX_LABEL_CHARS = 256
KEYS = {"alice": "sk-alice-team-a", "bob": "sk-bob-team-b"}
ADMIN = "sk-admin"
MODEL = "mock-llama"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings")
PRINTABLE = string.ascii_letters + string.digits + "-_.:/@"


def keyed_config(directory: Path) -> str:
    """Two keys of two tenants (team-a, team-b), an admin key, one objective. The keys may name any fairness id
    and band (a platform's own gateway acting for its users): what they send reaches flow control's series."""
    grants = {"may_set_fairness_id": True, "max_priority": 1_000_000}
    config = {
        "auth": {"keys": [{"hash": hash_api_key(secret), "name": name, **grants} for name, secret in KEYS.items()],
                 "admin_key_hashes": [hash_api_key(ADMIN)]},
        "flow_control": {"keys": {"alice": "team-a", "bob": "team-b"},
                         "tenants": {"team-a": {"weight": 2}, "team-b": {}},
                         "objectives": {"interactive": {"priority": 10}}},
    }
    path = directory / "keyed.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[GatewayProcess]:
    with gateway_process("--config", keyed_config(tmp_path), "--workers", "2", "--mock-pods", "1",
                         "--mock-speed", "0") as run:
        yield run


@pytest.fixture
def open_gateway() -> Iterator[GatewayProcess]:
    with gateway_process("--workers", "1", "--mock-pods", "1", "--mock-speed", "0") as run:
        yield run


def text(rng: random.Random, longest: int) -> str:
    return "".join(rng.choices(PRINTABLE, k=rng.randint(1, longest)))


def model_name(rng: random.Random, n: int) -> str:
    """Half served (so that requests reach flow control, a pod and the usage tallies), the rest a client's
    invention: short, long, a served name's look-alike, and twice a megabyte."""
    if n < 2:
        return "m" * 1_000_000
    roll = rng.random()
    if roll < 0.5:
        return MODEL
    if roll < 0.7:
        return text(rng, 40)
    if roll < 0.85:
        return MODEL + text(rng, 20)
    return text(rng, 5000)


def mostly_valid(rng: random.Random, limit: int) -> str:
    """Within the gateway's limit for the header nearly always (the request goes on), now and then past it."""
    return text(rng, limit if rng.random() < 0.95 else 4 * limit)


def priority(rng: random.Random) -> str:
    roll = rng.random()
    return str(rng.randint(-1000, 1000)) if roll < 0.95 else str(rng.randint(1001, 10**9)) if roll < 0.97 \
        else text(rng, 20)


def random_headers(rng: random.Random, keyed: bool) -> dict[str, str]:
    headers = {"x-gateway-inference-fairness-id": mostly_valid(rng, 128), "x-priority": priority(rng),
               "x-workflow-id": mostly_valid(rng, 256), "x-stage-id": mostly_valid(rng, 256),
               "x-session-id": mostly_valid(rng, 256), "x-request-id": mostly_valid(rng, 256)}
    if rng.random() < 0.3:
        headers["x-gateway-inference-objective"] = text(rng, 60) if rng.random() < 0.5 else "interactive"
    roll = rng.random()
    if keyed and roll < 0.8:  # the tenants' own keys, most of the time
        name = "alice" if roll < 0.4 else "bob"
        headers["authorization" if roll < 0.6 else "x-api-key"] = (
            f"Bearer {KEYS[name]}" if roll < 0.6 else KEYS[name])
    elif roll < 0.9:
        headers["x-api-key"] = text(rng, 500)
    return headers


def body_for(route: str, model: str) -> dict[str, Any]:
    if route == "/v1/completions":
        return {"model": model, "prompt": "Say hi", "max_tokens": 4}
    if route == "/v1/responses":
        return {"model": model, "input": "Say hi", "max_output_tokens": 4}
    if route == "/v1/embeddings":
        return {"model": model, "input": "Say hi"}
    return {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}


async def flood(http: aiohttp.ClientSession, url: str, keyed: bool, seed: int) -> dict[int, int]:
    """``REQUESTS`` requests, 16 at a time: how many were answered with each status."""
    rng = random.Random(seed)
    plan = [(rng.choice(ROUTES), model_name(rng, n), random_headers(rng, keyed)) for n in range(REQUESTS)]
    statuses: dict[int, int] = {}

    async def client(start: int) -> None:
        for route, model, headers in plan[start::16]:
            async with http.post(url + route, json=body_for(route, model), headers=headers) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1

    await asyncio.gather(*(client(i) for i in range(16)))
    return statuses


async def warm_up(url: str, headers: dict[str, str]) -> None:
    """Until every worker answers: each of 20 new connections in a row (the kernel spreads them over the
    workers) served, as a worker whose first health check is yet to answer would not."""
    served = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for _ in range(300):
            async with http.post(f"{url}/v1/chat/completions", json=body_for("", MODEL), headers=headers) as resp:
                served = served + 1 if resp.status == 200 else 0
            if served == 20:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the gateway's workers did not all serve")


async def scrape(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    """``/metrics`` with every worker's counts in it (a sibling slow to answer is left out of one scrape)."""
    for _ in range(10):
        async with http.get(f"{url}/metrics", headers=headers) as resp:
            assert resp.status == 200
            text = await resp.text()
        if "gateway_workers_unscraped 1" not in text:
            return text
        await asyncio.sleep(0.5)
    raise AssertionError("a worker left out of every scrape")


def check_bounded(exposition: str, answered: dict[int, int]) -> None:
    size = len(exposition.encode())
    families = list(text_string_to_metric_families(exposition))
    longest = max((value for f in families for s in f.samples for value in s.labels.values()), key=len)
    recorded = sum(s.value for f in families if f.name == "gateway_requests" for s in f.samples
                   if s.name == "gateway_requests_total" and s.labels["route"] != "/metrics")
    print(f"\n/metrics {size} bytes, {sum(len(f.samples) for f in families)} samples, longest label "
          f"{len(longest)} chars; answered {sorted(answered.items())}")
    assert answered.get(200, 0) >= 50, answered  # the flood reached the pods, not only the gateway's refusals
    assert recorded >= REQUESTS + 20  # every answer recorded (a refusal the same as a success)
    assert len(longest) <= MAX_LABEL_CHARS, longest[:200]
    assert size <= MAX_METRICS_BYTES, size


async def test_a_keyed_gateway_of_two_workers_keeps_metrics_bounded(keyed: GatewayProcess):
    admin = {"authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await warm_up(keyed.url, {"authorization": f"Bearer {KEYS['alice']}"})
        answered = await flood(http, keyed.url, keyed=True, seed=54)
        check_bounded(await scrape(http, keyed.url, admin), answered)


async def test_a_gateway_without_keys_keeps_metrics_bounded(open_gateway: GatewayProcess):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await warm_up(open_gateway.url, {})
        answered = await flood(http, open_gateway.url, keyed=False, seed=56)
        check_bounded(await scrape(http, open_gateway.url, {}), answered)


async def test_spans_carry_no_client_string_past_the_label_cap(start_mock_pod, http):
    pod = await start_mock_pod()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = load_config(overrides={"pods": [{"url": pod.url}], "tracing": {"enabled": True}}, environ={})
    runner = await serve_app(build_app(build_gateway(config, tracer_provider=provider)))
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rng = random.Random(4)
    sent = [("".join(rng.choices(PRINTABLE, k=5000)), {}), (MODEL, {"x-request-id": text(rng, 3000)}),
            (MODEL, {"x-gateway-inference-fairness-id": text(rng, 128), "x-workflow-id": text(rng, 256)})]
    try:
        statuses = []
        for model, headers in sent:
            async with http.post(f"{url}/v1/chat/completions", json=body_for("", model), headers=headers) as resp:
                statuses.append(resp.status)
        assert statuses == [404, 400, 200]
        spans = exporter.get_finished_spans()
        roots = [s for s in spans if s.name == "POST /v1/chat/completions"]
        assert len(roots) == 3 and len(roots[0].attributes["gen_ai.request.model"]) == MAX_LABEL_CHARS
        for span in spans:
            for name, value in span.attributes.items():
                for item in value if isinstance(value, tuple) else (value,):
                    assert not isinstance(item, str) or len(item) <= MAX_LABEL_CHARS, (span.name, name)
    finally:
        await runner.cleanup()
