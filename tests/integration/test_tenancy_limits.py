"""Issue 54, limits: two keys of two tenants (alice of team-a, limited per key; bob of team-b, limited per
tenant) against 1 worker, 2 workers, and 2 replicas of 2 workers sharing a real Redis (in one test process,
Unix datagrams between workers). One pod counts what runs on it at once, per key. Each guarantee is one
test: requests per minute, a client sending one request at a time never refused for concurrency, the
concurrency bound under 20 clients, and a request leaving the count however it ends (a worker gone silent
included: its requests are a lease that expires)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.config import hash_api_key
from tests.conftest import eventually, models_of
from tests.integration.test_key_limits import FAST_BUS, minute_to_spare, run_dirs, workers

__all__ = ["run_dirs"]  # the fixture, used by name

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
TENANTS = {"alice": "team-a", "bob": "team-b"}
TOPOLOGIES = ["1 worker", "2 workers", "2 replicas x 2 workers"]
MODEL = "m"


def auth(**alice: Any) -> dict[str, Any]:
    return {"keys": [{"hash": hash_api_key(KEYS["alice"]), "name": "alice", **alice},
                     {"hash": hash_api_key(KEYS["bob"]), "name": "bob"}]}


def bearer(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


class CountingPod:
    """A pod speaking OpenAI's chat API that counts the requests running on it at once, per key (the client's
    Authorization reaches it); a request says how it wants to end: ``hold`` (until released), ``fail``
    (a 500), anything else (answered after ``hold_s``)."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self.running: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self.release = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", models_of(MODEL))
        return app

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        who = request.headers.get("authorization", "")
        content = body["messages"][-1]["content"]
        self.running[who] += 1
        self.most[who] = max(self.most[who], self.running[who])
        try:
            if content == "hold":
                await self.release.wait()
            elif self.hold_s:
                await asyncio.sleep(self.hold_s)
        finally:
            self.running[who] -= 1
        if content == "fail":
            return web.json_response({"error": {"message": "injected", "type": "InternalServerError"}}, status=500)
        self.served[who] += 1
        return web.json_response({"id": "c", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "ok"}}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

    def most_of(self, name: str) -> int:
        return self.most[f"Bearer {KEYS[name]}"]


async def start(topology: str, start_gateway, start_backend, redis_server, run_dirs, pod: CountingPod,
                **config: Any) -> list[Any]:
    """The gateways of ``topology`` in front of ``pod``, each hearing all the others."""
    url = await start_backend(pod.app())
    config = {"flow_control": {"keys": TENANTS}, "routing": {"max_retries": 0}, **config}
    if topology == "1 worker":
        identities: list[Any] = [None]
    elif topology == "2 workers":
        identities = workers("r", run_dirs[0])
        config["shared_state"] = FAST_BUS
    else:
        identities = workers("ra", run_dirs[0]) + workers("rb", run_dirs[1])
        config["shared_state"] = {**FAST_BUS, "redis_url": redis_server.url}
    gateways = [await start_gateway([{"url": url, "models": [MODEL]}], identity=identity, **config)
                for identity in identities]
    await eventually(lambda: all(len(g.kits.shared.bus.peers) == len(gateways) - 1 for g in gateways), within_s=10)
    return gateways


async def ask(http: aiohttp.ClientSession, gw: Any, name: str, content: str = "hi") -> tuple[int, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=bearer(name)) as resp:
        payload = await resp.json()
        return resp.status, "" if resp.status == 200 else payload["error"].get("code") or ""


def in_flight(gw: Any, scope: str) -> int:
    return gw.kits.limits.limits.usage.used(scope).in_flight


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_requests_per_minute_hold_per_key_and_per_tenant_over_every_process(
        topology, start_gateway, start_backend, http, redis_server, run_dirs):
    """alice's own rate (``auth.keys[].requests_per_minute: 20``) and team-b's (``limits.tenants``): 8 clients
    each, spread over every process, press on them until refused for a while. Before: a rate per process (40
    served on two workers, 80 on 2 x 2), and no rate for a tenant."""
    pod = CountingPod()
    gateways = await start(topology, start_gateway, start_backend, redis_server, run_dirs, pod,
                           auth=auth(requests_per_minute=20),
                           limits={"tenants": {"team-b": {"requests_per_minute": 20}}})
    await asyncio.sleep(minute_to_spare(20))  # the whole burst inside one wall-clock minute
    served: Counter[str] = Counter()

    async def client(name: str, n: int) -> None:
        last_ok, i = time.monotonic(), n
        while time.monotonic() - last_ok < 2.5:  # past any charge's confirmation window
            status, code = await ask(http, gateways[i % len(gateways)], name)
            if status == 200:
                served[name] += 1
                last_ok = time.monotonic()
            else:
                assert status == 429 and code == "rate_limit_exceeded", (status, code)
                await asyncio.sleep(0.05)
            i += 1

    await asyncio.gather(*(client(name, n) for name in KEYS for n in range(8)))
    assert 15 <= served["alice"] <= 22 and 15 <= served["bob"] <= 22, served  # the limit + 10%


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_one_request_at_a_time_is_never_refused_for_concurrency(
        topology, start_gateway, start_backend, http, redis_server, run_dirs):
    """``max_concurrent: 4`` for alice's key and for team-b: each sends 100 requests one after the other,
    to each process in turn. Before: 45 of 100 refused on two workers (ended requests counted as in flight)."""
    pod = CountingPod()
    gateways = await start(topology, start_gateway, start_backend, redis_server, run_dirs, pod, auth=auth(),
                           limits={"keys": {"alice": {"max_concurrent": 4}},
                                   "tenants": {"team-b": {"max_concurrent": 4}}})
    refused: Counter[str] = Counter()

    async def sequential(name: str) -> None:
        for i in range(100):
            status, code = await ask(http, gateways[i % len(gateways)], name)
            if status != 200:
                refused[f"{name} {status} {code}"] += 1

    await asyncio.gather(sequential("alice"), sequential("bob"))
    assert not refused and pod.served == {"Bearer sk-alice": 100, "Bearer sk-bob": 100}, refused


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_max_concurrent_holds_under_20_clients(topology, start_gateway, start_backend, http, redis_server,
                                                     run_dirs):
    """20 clients of alice and 20 of team-b's bob, spread over every process, each until 4 of its requests
    were answered (a refused one retries): at most 4 of each key at once on the pod, and all 80 answered."""
    pod = CountingPod(hold_s=0.1)
    gateways = await start(topology, start_gateway, start_backend, redis_server, run_dirs, pod, auth=auth(),
                           limits={"keys": {"alice": {"max_concurrent": 4}},
                                   "tenants": {"team-b": {"max_concurrent": 4}}})
    refused: Counter[str] = Counter()

    async def client(name: str, n: int) -> None:
        answered, i = 0, n
        while answered < 4:
            status, code = await ask(http, gateways[i % len(gateways)], name)
            if status == 200:
                answered += 1
            else:
                assert status == 429 and code == "concurrency_limit_exceeded", (status, code)
                refused[name] += 1
                await asyncio.sleep(0.02)
            i += 1

    await asyncio.gather(*(client(name, n) for name in KEYS for n in range(20)))
    assert pod.most_of("alice") <= 4 and pod.most_of("bob") <= 4, pod.most
    assert refused["alice"] and refused["bob"]  # the bound was pressed on
    assert pod.served == {"Bearer sk-alice": 80, "Bearer sk-bob": 80}


async def silence(gw: Any) -> None:
    """As if the process were killed: nothing more is heard from it (not even its requests' ends)."""
    bus = gw.kits.shared.bus
    bus._task.cancel()
    if bus._siblings is not None:
        bus._siblings.stop()
    if bus._redis is not None:
        await bus._redis.stop()


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_a_request_leaves_the_count_however_it_ends(topology, start_gateway, start_backend, http,
                                                          redis_server, run_dirs):
    """alice may have 1 request at once, team-b 1: after each way a request can end (answered, the pod
    failing, its client gone, and with several processes the process holding it gone silent), the next request
    is admitted by every process."""
    pod = CountingPod()
    gateways = await start(topology, start_gateway, start_backend, redis_server, run_dirs, pod, auth=auth(),
                           limits={"keys": {"alice": {"max_concurrent": 1}},
                                   "tenants": {"team-b": {"max_concurrent": 1}}})
    scopes = {"alice": "key:alice", "bob": "tenant:team-b"}

    async def ended_everywhere(name: str, alive: list[Any]) -> None:
        """Once every process knows the request before ended (a batch later)."""
        await eventually(lambda: all(in_flight(g, scopes[name]) == 0 for g in alive), within_s=10)

    async def next_one_admitted(name: str, alive: list[Any]) -> None:
        for gw in alive:
            await ended_everywhere(name, alive)
            assert await ask(http, gw, name) == (200, ""), name
        await ended_everywhere(name, alive)

    for name in KEYS:
        assert (await ask(http, gateways[0], name))[0] == 200  # answered
        await next_one_admitted(name, gateways)
        assert (await ask(http, gateways[-1], name, "fail"))[0] >= 500  # failed
        await next_one_admitted(name, gateways)
        held = asyncio.create_task(ask(http, gateways[0], name, "hold"))  # its client gone
        await eventually(lambda name=name: all(in_flight(g, scopes[name]) == 1 for g in gateways), within_s=10)
        assert [(await ask(http, gw, name))[1] for gw in gateways] == ["concurrency_limit_exceeded"] * len(gateways)
        held.cancel()
        await next_one_admitted(name, gateways)
    if len(gateways) == 1:
        return
    held_tasks = [asyncio.create_task(ask(http, gateways[0], name, "hold")) for name in KEYS]
    await eventually(lambda: all(in_flight(g, scope) == 1 for g in gateways for scope in scopes.values()),
                     within_s=10)
    await silence(gateways[0])  # the process holding both requests stops being heard from
    for name in KEYS:  # once its lease (peer_timeout_s, 1 s here) ran out, each of the others admits the next
        for gw in gateways[1:]:
            admitted = False
            for _ in range(50):
                await ended_everywhere(name, gateways[1:])
                if await ask(http, gw, name) == (200, ""):
                    admitted = True
                    break
                await asyncio.sleep(0.2)
            assert admitted, (name, gw.kits.foundation.identity.name)
    pod.release.set()
    await asyncio.gather(*held_tasks, return_exceptions=True)
