"""Keys with limits, admin endpoints, upstream credentials, and pods that fail mid-stream or stall."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from gateway.config import hash_api_key
from gateway.logs import ACCESS_LOGGER
from simulator.pod import free_port
from tests.conftest import chat_body, eventually, models_of
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
    for path in ("/debug/pods", "/debug/index", "/debug/workflows", "/debug/steps", "/metrics"):
        async with http.get(gw.url + path) as resp:
            assert resp.status == 401
        async with http.get(gw.url + path, headers={"authorization": "Bearer admin"}) as resp:
            assert resp.status == 200
    async with http.get(f"{gw.url}/healthz") as resp:
        assert resp.status == 200  # probes stay open
    closed = await start_gateway([url], auth={"debug_endpoints": False})
    async with http.get(f"{closed.url}/debug/pods") as hidden, http.get(f"{closed.url}/debug/nothing") as missing:
        assert hidden.status == missing.status == 404
        assert_openai_error(await hidden.json(), "not_found")
        # A hidden endpoint reads exactly as one that does not exist.
        assert (await hidden.json())["error"]["type"] == (await missing.json())["error"]["type"] == "not_found_error"
        assert (await hidden.json())["error"]["message"] == "No route for GET /debug/pods."


CHAT = "/v1/chat/completions"


def recorded(gw, caplog) -> tuple[dict[str, float], list[str], float]:
    """What the gateway recorded of its chat requests: their count by status and outcome in metrics, the same
    in its access log, and how many answers it learnt output lengths from."""
    registry = gw.kits.foundation.metrics.registry
    by_answer = {}
    for family in registry.collect():
        if family.name == "gateway_requests":
            for sample in family.samples:
                if sample.name == "gateway_requests_total" and sample.labels["route"] == CHAT:
                    by_answer[f"{sample.labels['status']} {sample.labels['outcome']}"] = sample.value
    logged = [f"{r.status} {r.outcome}" for r in caplog.records if r.name == ACCESS_LOGGER and r.route == CHAT]
    learnt = registry.get_sample_value("gateway_output_tokens_count", {"kind": "actual"}) or 0.0
    return by_answer, logged, learnt


async def test_pod_dying_mid_stream_ends_the_stream_with_an_error_event(start_mock_pod, start_gateway, http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
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
    # The client saw 200 headers, but the request failed: recorded as such, and nothing learnt from it.
    assert recorded(gw, caplog) == ({"200 upstream_broke": 1.0}, ["200 upstream_broke"], 0.0)


async def test_stalled_stream_hits_the_idle_timeout(start_backend, start_gateway, http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(1, 6):  # five tokens' worth, then silence: not an output length to learn from
            await resp.write(b'data: {"n": %d}\n\n' % n)
        await asyncio.sleep(30)
        return resp

    gw = await start_gateway([await start_backend(backend(stalls))], timeouts={"idle_s": 0.3, "first_byte_s": 5})
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m", stream=True)) as resp:
        body = await asyncio.wait_for(resp.read(), timeout=10)
    assert body.startswith(b'data: {"n": 1}') and b"idle_timeout" in body
    assert recorded(gw, caplog) == ({"200 upstream_broke": 1.0}, ["200 upstream_broke"], 0.0)


async def test_a_streams_first_chunk_waits_first_byte_s_and_each_later_one_idle_s(start_backend, start_gateway, http,
                                                                                  caplog):
    """An engine sends a stream's headers at once and its first event once the prompt is prefilled (vLLM, the
    simulator): that first event is the answer's first byte, bounded by ``first_byte_s``, not ``idle_s``."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)

    async def prefills_then_streams(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)  # the headers go at once
        await asyncio.sleep(1.2)  # the prefill (a queue, a long prompt)
        for n in range(1, 4):
            await resp.write(b'data: {"n": %d}\n\n' % n)
            await asyncio.sleep(0.02)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    url = await start_backend(backend(prefills_then_streams))
    patient = await start_gateway([url], timeouts={"first_byte_s": 5, "idle_s": 0.4})
    async with http.post(f"{patient.url}/v1/chat/completions", json=chat_body(model="m", stream=True)) as resp:
        body = await asyncio.wait_for(resp.read(), timeout=10)
    assert body.endswith(b"data: [DONE]\n\n") and b"error" not in body  # idle_s is for the gaps after it
    assert recorded(patient, caplog)[0] == {"200 ok": 1.0}
    strict = await start_gateway([url], timeouts={"first_byte_s": 0.4, "idle_s": 5})
    async with http.post(f"{strict.url}/v1/chat/completions", json=chat_body(model="m", stream=True)) as resp:
        body = await asyncio.wait_for(resp.read(), timeout=10)
    assert b'data: {"n"' not in body and b"first_byte_timeout" in body  # cut at first_byte_s, not idle_s
    assert recorded(strict, caplog)[0] == {"200 upstream_broke": 1.0}
    errors = strict.kits.foundation.metrics.registry.get_sample_value("gateway_upstream_errors_total",
                                                              {"pod": strict.kits.foundation.pods.all()[0].name,
                                                               "kind": "first_byte_timeout"})
    assert errors == 1


async def test_limits_on_messages_and_prompt_length(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod(max_model_len=64)
    gw = await start_gateway([pod.url], routing={"policy": "kv_aware"}, server={"max_messages": 3},
                             tokenization={"default_mode": "remote"})
    many = {"model": "mock-llama", "messages": [{"role": "user", "content": "hi"}] * 4}
    async with http.post(f"{gw.url}/v1/chat/completions", json=many) as resp:
        assert resp.status == 400
        assert_openai_error(await resp.json(), "too_many_messages")
    long = {"model": "mock-llama", "messages": [{"role": "user", "content": "word " * 200}]}
    async with http.post(f"{gw.url}/v1/chat/completions", json=long) as resp:
        assert resp.status == 400
        error = assert_openai_error(await resp.json(), "context_length_exceeded")
        assert "64 tokens" in error["message"]
    assert pod.engine.prompt_tokens_total == 0  # refused before reaching the pod


async def test_a_client_that_stops_reading_is_cut_off(start_backend, start_gateway, http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    upstream_gone = asyncio.Event()

    async def firehose(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chunk = b'data: {"x": "' + b"x" * 65536 + b'"}\n\n'
        try:
            for _ in range(2000):  # 128 MB if nobody stopped it
                await resp.write(chunk)
        except (ConnectionResetError, asyncio.CancelledError):
            upstream_gone.set()
            raise
        return resp

    gw = await start_gateway([await start_backend(backend(firehose))], server={"client_stall_s": 0.5})
    _reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true}'
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()  # ... and never read the answer
    await asyncio.wait_for(upstream_gone.wait(), timeout=20)
    writer.close()
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'side="client_stalled"' in metrics
    await eventually(lambda: recorded(gw, caplog)[0] == {"200 client_stalled": 1.0})
    assert recorded(gw, caplog) == ({"200 client_stalled": 1.0}, ["200 client_stalled"], 0.0)


@pytest.fixture
def tls_cert(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


async def test_tls_listener(start_backend, http, tls_cert):
    cert, key = tls_cert
    port = free_port()
    env = {**os.environ, "GATEWAY_SERVER__TLS_CERT": str(cert), "GATEWAY_SERVER__TLS_KEY": str(key)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--port", str(port), "--pod",
        await start_backend(backend(echo_auth)), env=env, stderr=asyncio.subprocess.DEVNULL)
    try:
        context = ssl.create_default_context(cafile=str(cert))
        for _ in range(100):
            try:
                async with http.get(f"https://127.0.0.1:{port}/healthz", ssl=context) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                await asyncio.sleep(0.1)
        async with http.post(f"https://127.0.0.1:{port}/v1/chat/completions", json=chat_body(model="m"),
                             ssl=context) as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientError):  # plain HTTP is refused on a TLS port
            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                await resp.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), timeout=30)
