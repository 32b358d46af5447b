"""Routing policies over real backends: which pod was chosen, and why."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from aiohttp import web

from tests.conftest import chat_body, models_of


def counting_backend(name: str, hits: Counter, hold: asyncio.Event | None = None,
                     health_status: int = 200) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        hits[name] += 1
        if hold is not None:
            await hold.wait()
        return web.json_response({"pod": name})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=health_status)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models_of("m"))
    app.router.add_get("/health", health)
    return app


async def decisions(http, gw) -> dict[tuple[str, str], float]:
    text = await (await http.get(f"{gw.url}/metrics")).text()
    out = {}
    for line in text.splitlines():
        if line.startswith("gateway_routing_decisions_total{"):
            labels, value = line[len("gateway_routing_decisions_total{"):].split("} ")
            parts = dict(kv.split("=") for kv in labels.split(","))
            out[(parts["policy"].strip('"'), parts["reason"].strip('"'))] = float(value)
    return out


async def test_round_robin_spreads_evenly(start_backend, start_gateway, http):
    hits: Counter = Counter()
    urls = [await start_backend(counting_backend(f"p{i}", hits)) for i in range(4)]
    gw = await start_gateway(urls, routing={"policy": "round_robin"})
    chosen = Counter()
    for _ in range(40):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-policy"] == "round_robin"
            chosen[(await resp.json())["pod"]] += 1
    assert chosen == Counter({"p0": 10, "p1": 10, "p2": 10, "p3": 10})
    assert await decisions(http, gw) == {("round_robin", "rotation"): 40.0}


async def one_by_one_beside_a_busy_pod(start_backend, start_gateway, http, policy: str, n: int) -> dict:
    """``n`` requests one after another to a gateway with ``policy`` over two pods, one of which ("busy")
    holds every request it gets until the end; each request that went to the other ("idle") answered with
    the policy's header. Returns the gateway's decisions."""
    hits: Counter = Counter()
    hold = asyncio.Event()
    busy = await start_backend(counting_backend("busy", hits, hold=hold))
    idle = await start_backend(counting_backend("idle", hits))
    gw = await start_gateway([busy, idle], routing={"policy": policy}, timeouts={"first_byte_s": 20})
    held = []
    for _ in range(n):
        busy_before, total_before = hits["busy"], sum(hits.values())
        task = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")))
        while sum(hits.values()) == total_before:  # wait until a pod has received it
            await asyncio.sleep(0.005)
        if hits["busy"] > busy_before:
            held.append(task)  # stays in flight on the busy pod
        else:
            resp = await task
            assert resp.status == 200 and resp.headers["x-gateway-policy"] == policy
            assert (await resp.json())["pod"] == "idle"
    # Once the busy pod holds one request, every later one goes to the idle pod.
    assert hits["busy"] <= 1 and hits["idle"] >= n - 1
    made = await decisions(http, gw)
    hold.set()
    for task in held:
        assert (await task).status == 200
    return made


async def test_least_request_prefers_the_idle_pod(start_backend, start_gateway, http):
    made = await one_by_one_beside_a_busy_pod(start_backend, start_gateway, http, "least_request", 20)
    assert made[("least_request", "least_in_flight")] == 20.0


async def test_least_request_splits_a_burst_evenly(start_backend, start_gateway, http):
    hits: Counter = Counter()
    hold = asyncio.Event()
    urls = [await start_backend(counting_backend(f"p{i}", hits, hold=hold)) for i in range(2)]
    gw = await start_gateway(urls, routing={"policy": "least_request"})
    tasks = [asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")))
             for _ in range(10)]
    while sum(hits.values()) < 10:
        await asyncio.sleep(0.01)
    # In-flight counts rise before the request is sent, so a burst splits evenly.
    assert hits == Counter({"p0": 5, "p1": 5})
    assert sorted(gw.kits.shared.ledger.on_pod(p.name) for p in gw.kits.foundation.pods.all()) == [5, 5]
    hold.set()
    assert [r.status for r in await asyncio.gather(*tasks)] == [200] * 10


async def test_unhealthy_pod_receives_nothing(start_backend, start_gateway, http):
    hits: Counter = Counter()
    sick = await start_backend(counting_backend("sick", hits, health_status=503))
    urls = [await start_backend(counting_backend(f"p{i}", hits)) for i in range(2)]
    gw = await start_gateway([{"url": sick, "models": ["m"]}, *urls])
    for policy in ("round_robin", "random", "least_request"):
        for _ in range(10):
            async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                                 headers={"x-routing-strategy": policy}) as resp:
                assert resp.status == 200 and resp.headers["x-gateway-policy"] == policy
    assert hits["sick"] == 0 and hits["p0"] + hits["p1"] == 30
    pods = {p["url"]: p for p in (await (await http.get(f"{gw.url}/debug/pods")).json())["pods"]}
    assert pods[sick]["healthy"] is False and "503" in pods[sick]["last_error"]


async def test_retry_before_first_byte_moves_to_another_pod(start_backend, start_gateway, http):
    from simulator.pod import free_port

    hits: Counter = Counter()
    dead = f"http://127.0.0.1:{free_port()}"
    alive = await start_backend(counting_backend("alive", hits))
    gw = await start_gateway([{"url": dead, "models": ["m"], "name": "dead"}, {"url": alive, "name": "alive"}],
                             health={"interval_s": 60})
    gw.kits.foundation.pods.get("dead").healthy = True  # as if it died right after its last health check
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-pod"] == "alive"
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_retries_total{cause="connect",pod="dead"} 1.0' in metrics
    # Passive ejection: the dead pod is skipped without another failed try.
    dead_pod = gw.kits.foundation.pods.get("dead")
    assert dead_pod.ejections == 1 and not dead_pod.available(time.monotonic())
    for _ in range(5):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
            assert resp.headers["x-gateway-pod"] == "alive"
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_retries_total{cause="connect",pod="dead"} 1.0' in metrics
    assert hits["alive"] == 6


async def test_retry_after_backend_500(start_backend, start_gateway, http):
    hits: Counter = Counter()

    async def failing(request: web.Request) -> web.Response:
        hits["failing"] += 1
        return web.Response(status=503, text="overloaded")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", failing)
    app.router.add_get("/v1/models", models_of("m"))
    gw = await start_gateway([{"url": await start_backend(app), "name": "failing"},
                              {"url": await start_backend(counting_backend("good", hits)), "name": "good"}])
    for _ in range(4):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
            assert resp.status == 200 and resp.headers["x-gateway-pod"] == "good"
    # Round robin keeps offering the failing pod until three 5xx in a row eject it.
    assert hits == Counter({"good": 4, "failing": 3})
    assert gw.kits.foundation.pods.get("failing").ejections == 1


async def test_a_restarted_pod_is_back_within_two_health_intervals(start_backend, start_gateway, http):
    """A pod that dies under a burst of requests, then comes back: every failed request of the burst is the
    same outage (one ejection, not a backoff grown to its cap), and its first passing health check ends the
    ejection, so it serves again within two health intervals of being up."""
    from tests.conftest import serve_app

    hits: Counter = Counter()
    interval = 0.3
    restartable = await serve_app(counting_backend("restarted", hits))
    port = restartable.addresses[0][1]
    gw = await start_gateway([{"url": f"http://127.0.0.1:{port}", "name": "restarted"},
                              {"url": await start_backend(counting_backend("steady", hits)), "name": "steady"}],
                             health={"interval_s": interval, "timeout_s": 0.2, "failure_threshold": 3,
                                     "success_threshold": 1, "ejection_base_s": 1.0, "ejection_max_s": 30.0})
    await restartable.cleanup()  # the pod dies
    burst = [http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) for _ in range(40)]
    for resp in await asyncio.gather(*burst):
        assert resp.status == 200 and resp.headers["x-gateway-pod"] == "steady"
        resp.release()
    pod = gw.kits.foundation.pods.get("restarted")
    assert pod.ejections == 1
    site_app = counting_backend("restarted", hits)
    revived = web.AppRunner(site_app)
    await revived.setup()
    await web.TCPSite(revived, "127.0.0.1", port).start()  # the same pod, restarted
    up_at = time.monotonic()
    try:
        while hits["restarted"] == 0:
            assert time.monotonic() - up_at < 2 * interval * 1.1 + 0.3, "the restarted pod stayed out of rotation"
            async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.02)
    finally:
        await revived.cleanup()


async def test_prefix_cache_sends_each_shared_prefix_back_to_its_pod(start_backend, start_gateway, http):
    hits: Counter = Counter()
    urls = [await start_backend(counting_backend(f"p{i}", hits)) for i in range(3)]
    gw = await start_gateway(urls, routing={"policy": "prefix_cache"})
    chosen: dict[str, list[str]] = {}
    for group in ("reviewer", "planner"):
        system = f"{group}: you work on a large Python codebase and answer with diffs only. " * 20
        for i in range(4):
            body = {"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": system},
                                                                {"role": "user", "content": f"question {i}"}]}
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["x-gateway-policy"] == "prefix_cache"
                chosen.setdefault(group, []).append((await resp.json())["pod"])
    # Each group's later prompts follow its first to the pod the gateway sent it to.
    assert all(pods == pods[:1] * 4 for pods in chosen.values()), chosen
    made = await decisions(http, gw)
    assert made[("prefix_cache", "approximate")] == 8.0 and sum(made.values()) == 8.0, made


async def test_throughput_sends_requests_where_the_most_headroom_is_left(start_backend, start_gateway, http):
    # A request in flight on the busy pod takes a share of its capacity: every later one goes to the other.
    made = await one_by_one_beside_a_busy_pod(start_backend, start_gateway, http, "throughput", 12)
    assert made == {("throughput", "most_headroom"): 12.0}


async def test_the_gateway_exports_its_event_loop_lag(start_backend, start_gateway, http):
    hits: Counter = Counter()
    gw = await start_gateway([await start_backend(counting_backend("p0", hits))], server={"loop_lag_interval_s": 0.01})
    await asyncio.sleep(0.15)
    text = await (await http.get(f"{gw.url}/metrics")).text()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gateway_event_loop_lag_seconds")}
    assert samples["gateway_event_loop_lag_seconds_count"] >= 5, samples
    # Nothing stalls this loop: most samples are within a few ms of on time.
    assert samples['gateway_event_loop_lag_seconds_bucket{le="0.005"}'] >= \
        samples["gateway_event_loop_lag_seconds_count"] / 2, samples


async def test_a_profile_declared_in_config_routes_by_default_and_by_header(start_backend, start_gateway, http):
    hits: Counter = Counter()
    a100, h200 = [await start_backend(counting_backend(name, hits)) for name in ("a100", "h200")]
    profile = {"filters": ["saturated", "adapter_resident", "pin"], "picker": {"name": "max_score",
                                                                              "options": {"reason": "preferred"}},
               "scorers": [{"name": "deployment", "weight": 1.0, "options": {"prefer": ["h200"]}}]}
    gw = await start_gateway([{"url": a100, "deployment": "a100"}, {"url": h200, "deployment": "h200"}],
                             routing={"policy": "prefer_h200", "profiles": {"prefer_h200": profile}})
    for _ in range(3):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
            assert resp.status == 200 and resp.headers["x-gateway-policy"] == "prefer_h200"
            assert (await resp.json())["pod"] == "h200"
    # A shipped profile by header, beside the declared default.
    for _ in range(2):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                             headers={"x-routing-strategy": "round_robin"}) as resp:
            assert resp.headers["x-gateway-policy"] == "round_robin"
    assert hits == Counter({"h200": 4, "a100": 1})
    assert await decisions(http, gw) == {("prefer_h200", "preferred"): 3.0, ("round_robin", "rotation"): 2.0}
