"""Keys with limits, admin endpoints, upstream credentials, and pods that fail mid-stream or stall."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.config import hash_api_key
from tests.conftest import chat_body, models_of
from tests.integration.test_errors import assert_openai_error, backend


async def echo_auth(request: web.Request) -> web.Response:
    return web.json_response({"authorization": request.headers.get("authorization")})


async def test_key_models_and_rate_limit(start_backend, start_gateway, http):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", echo_auth)
    app.router.add_get("/v1/models", models_of("m", "other"))
    auth = {"keys": [{"hash": hash_api_key("sk-small"), "models": ["m"], "requests_per_minute": 2},
                     {"hash": hash_api_key("sk-big")}], "upstream": "strip"}
    gw = await start_gateway([{"url": await start_backend(app), "models": ["m", "other"]}], auth=auth)
    small = {"authorization": "Bearer sk-small"}
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="other"), headers=small) as resp:
        assert resp.status == 403
        assert_openai_error(await resp.json(), "model_not_allowed")
    for _ in range(2):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"), headers=small) as resp:
            assert resp.status == 200
            assert (await resp.json())["authorization"] is None  # stripped before the pod
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"), headers=small) as resp:
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
        assert_openai_error(await resp.json(), "rate_limit_exceeded")
    for _ in range(5):  # another key has its own (unlimited) budget and every model
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="other"),
                             headers={"authorization": "Bearer sk-big"}) as resp:
            assert resp.status == 200


async def test_admin_endpoints_need_the_admin_key_or_are_gone(start_backend, start_gateway, http):
    url = await start_backend(backend(echo_auth))
    gw = await start_gateway([url], auth={"admin_key_hashes": [hash_api_key("admin")]})
    for path in ("/debug/pods", "/debug/index", "/debug/workflows", "/metrics"):
        async with http.get(gw.url + path) as resp:
            assert resp.status == 401
        async with http.get(gw.url + path, headers={"authorization": "Bearer admin"}) as resp:
            assert resp.status == 200
    async with http.get(f"{gw.url}/healthz") as resp:
        assert resp.status == 200  # probes stay open
    closed = await start_gateway([url], auth={"debug_endpoints": False})
    async with http.get(f"{closed.url}/debug/pods") as resp:
        assert resp.status == 404
        assert_openai_error(await resp.json(), "not_found")


async def test_pod_dying_mid_stream_ends_the_stream_with_an_error_event(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod(speed=0.05)
    gw = await start_gateway([pod.url])
    await http.post(f"{pod.url}/debug/faults", json={"die_mid_stream_fraction": 1.0})
    async with http.post(f"{gw.url}/v1/chat/completions",
                         json=chat_body(model="mock-llama", stream=True, max_tokens=50)) as resp:
        assert resp.status == 200
        body = await asyncio.wait_for(resp.read(), timeout=10)
    assert b'data: {"error"' in body and b"[DONE]" not in body
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_stream_aborts_total{pod="' in metrics and 'side="upstream"' in metrics


async def test_stalled_stream_hits_the_idle_timeout(start_backend, start_gateway, http):
    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"n": 1}\n\n')
        await asyncio.sleep(30)
        return resp

    gw = await start_gateway([await start_backend(backend(stalls))], timeouts={"idle_s": 0.3, "first_byte_s": 5})
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m", stream=True)) as resp:
        body = await asyncio.wait_for(resp.read(), timeout=10)
    assert body.startswith(b'data: {"n": 1}') and b"idle_timeout" in body
