"""Every failure reaches the client as OpenAI error JSON with the documented status."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from gateway.config import hash_api_key
from simulator.pod import free_port
from tests.conftest import chat_body, models_of


def assert_openai_error(payload: dict, code: str | None = None) -> dict:
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["message"] and "Traceback" not in error["message"]
    if code:
        assert error["code"] == code
    return error


def backend(handler, model: str = "m") -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_get("/v1/models", models_of(model))
    return app


async def ok(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"id": "ok", "choices": [], "served_by": request.url.port})


@pytest.fixture
async def gw(start_backend, start_gateway):
    return await start_gateway([await start_backend(backend(ok))], server={"max_body_bytes": 4096})


@pytest.fixture
def answer_over(start_backend, start_gateway, http):
    """The gateway's status and JSON for a chat request, its one pod answering ``status`` with ``text``."""
    async def answer(status: int, text: str) -> tuple[int, dict]:
        async def pod(request: web.Request) -> web.Response:
            return web.Response(status=status, text=text)

        gw = await start_gateway([await start_backend(backend(pod))])
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
            return resp.status, await resp.json()

    return answer


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"", 400, "invalid_request", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (b'{"messages": []}', 400, "missing_model", "model"),
        (b'{"model": 42}', 400, "invalid_request", "model"),
        (b'{"model": "m", "stream": "yes"}', 400, "invalid_request", "stream"),
        (b'{"model": "other"}', 404, "model_not_found", "model"),
    ],
)
async def test_bad_requests(gw, http, body, status, code, param):
    async with http.post(f"{gw.url}/v1/chat/completions", data=body,
                         headers={"content-type": "application/json"}) as resp:
        assert resp.status == status
        assert resp.headers["content-type"].startswith("application/json")
        error = assert_openai_error(await resp.json(), code)
        assert error["param"] == param


async def test_oversized_body_is_413(gw, http):
    body = chat_body(model="m", messages=[{"role": "user", "content": "x" * 10_000}])
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 413
        assert_openai_error(await resp.json(), "request_too_large")


async def test_unknown_route_and_method(gw, http):
    async with http.get(f"{gw.url}/v1/nothing") as resp:
        assert resp.status == 404
        assert_openai_error(await resp.json(), "not_found")
    async with http.get(f"{gw.url}/v1/chat/completions") as resp:
        assert resp.status == 405
        assert_openai_error(await resp.json(), "method_not_allowed")


async def test_unknown_routing_strategy_is_400(gw, http):
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                         headers={"x-routing-strategy": "psychic"}) as resp:
        assert resp.status == 400
        error = assert_openai_error(await resp.json(), "unknown_routing_strategy")
        assert "round_robin" in error["message"]


async def test_all_pods_down_at_start_is_503(start_gateway, http):
    gw = await start_gateway([{"url": f"http://127.0.0.1:{free_port()}", "models": ["m"]}])
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
        assert resp.status == 503
        assert_openai_error(await resp.json(), "no_healthy_pod")
    async with http.get(f"{gw.url}/readyz") as resp:
        assert resp.status == 503


async def test_pod_dying_after_health_check_is_502(start_gateway, http):
    from tests.conftest import serve_app

    app = backend(ok)
    app.router.add_get("/health", ok)
    runner = await serve_app(app)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    gw = await start_gateway([url], health={"interval_s": 60})
    await runner.cleanup()  # the pod dies; the gateway still believes it healthy
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
        assert resp.status == 502
        error = assert_openai_error(await resp.json(), "bad_gateway")
        assert "unreachable" in error["message"]


async def test_backend_500_is_502_with_its_message(answer_over):
    status, body = await answer_over(500, "CUDA out of memory")
    assert status == 502
    error = assert_openai_error(body, "bad_gateway")
    assert "HTTP 500" in error["message"] and "CUDA out of memory" in error["message"]


async def test_a_pods_4xx_keeps_its_status_and_text_in_the_routes_shape(start_backend, start_gateway, http):
    """vLLM's own error shape (a Python class as the type, an integer code) becomes OpenAI's, or Anthropic's on
    its route; the pod's status and text are kept, and its param."""
    body = {"error": {"message": "too long", "type": "BadRequestError", "param": "messages", "code": 400}}

    async def refuses(request: web.Request) -> web.Response:
        return web.json_response(body, status=400)

    app = backend(refuses)
    app.router.add_post("/v1/messages", refuses)
    gw = await start_gateway([await start_backend(app)])
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
        assert resp.status == 400 and resp.headers["x-gateway-pod"]
        assert await resp.json() == {"error": {"message": "too long", "type": "invalid_request_error", "code": None,
                                               "param": "messages"}}
    messages = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{gw.url}/v1/messages", json=messages) as resp:
        assert resp.status == 400
        assert await resp.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "too long"}}


async def test_backend_timeout_is_504(start_backend, start_gateway, http):
    async def hangs(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    gw = await start_gateway([await start_backend(backend(hangs))], timeouts={"first_byte_s": 0.3})
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
        assert resp.status == 504
        assert_openai_error(await resp.json(), "gateway_timeout")


async def test_gateway_api_keys(start_backend, start_gateway, http):
    seen_auth = []

    async def record(request: web.Request) -> web.Response:
        seen_auth.append((request.headers.get("authorization"), request.headers.get("x-api-key")))
        return web.json_response({"ok": True})

    gw = await start_gateway(
        [await start_backend(backend(record))],
        auth={"api_key_hashes": [hash_api_key("sk-good")], "upstream": "replace", "upstream_api_key": "pod-key"},
    )
    for headers in ({}, {"authorization": "Bearer sk-bad"}, {"authorization": "Basic sk-good"},
                    {"x-api-key": "sk-bad"}, {"x-api-key": ""}):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"), headers=headers) as resp:
            assert resp.status == 401
            assert_openai_error(await resp.json(), "invalid_api_key")
        async with http.get(f"{gw.url}/v1/models", headers=headers) as resp:
            assert resp.status == 401
    # The key as the OpenAI SDK sends it (Bearer) and as the Anthropic SDK and Claude Code send it (x-api-key).
    for headers in ({"authorization": "Bearer sk-good"}, {"x-api-key": "sk-good"}):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"), headers=headers) as resp:
            assert resp.status == 200
    # The pod got the configured upstream key, never the client's gateway key.
    assert seen_auth == [("Bearer pod-key", None)] * 2


async def test_authorization_passthrough_by_default(start_backend, start_gateway, http):
    seen_auth = []

    async def record(request: web.Request) -> web.Response:
        seen_auth.append(request.headers.get("authorization"))
        return web.json_response({"ok": True})

    gw = await start_gateway([await start_backend(backend(record))])
    await http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                    headers={"authorization": "Bearer client-token"})
    await http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"), headers={"x-api-key": "client-key"})
    assert seen_auth == ["Bearer client-token", None]


async def test_non_json_upstream_errors_get_the_openai_shape(answer_over):
    status, body = await answer_over(409, "busy elsewhere")
    assert status == 409
    assert assert_openai_error(body)["message"] == "busy elsewhere"


async def test_an_endpoint_the_pods_do_not_serve_says_so(start_backend, start_gateway, http):
    """A pod answering 404 for the path itself (FastAPI's {"detail": "Not Found"}, aiohttp's text) is an
    endpoint the fleet does not implement (501), not a routing fault."""
    gw = await start_gateway([await start_backend(backend(ok))])
    async with http.post(f"{gw.url}/v1/responses", json={"model": "m", "input": "hi"}) as resp:
        assert resp.status == 501
        error = assert_openai_error(await resp.json(), "unsupported_endpoint")
        assert error["message"] == "The pods serving this model do not implement /v1/responses (they answered 404)."


async def test_out_of_range_token_ids_are_a_clean_400(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], routing={"policy": "kv_aware"})
    for prompt in ([-1, 5], [2**40], [[3, -2]]):
        async with http.post(f"{gw.url}/v1/completions", json={"model": "mock-llama", "prompt": prompt}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert ("Token ids" in error["message"]) if prompt == [2**40] else error["param"] == "prompt"
    async with http.post(f"{gw.url}/v1/completions", json={"model": "mock-llama", "prompt": [1, 2, 3]}) as resp:
        assert resp.status == 200  # the engine loop survived


async def test_request_content_never_reaches_the_logs(start_backend, start_gateway, http, caplog):
    import logging

    gw = await start_gateway([await start_backend(backend(ok))])
    secret = "my-credit-card-4111-1111"
    with caplog.at_level(logging.DEBUG):
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(secret, model="m")) as resp:
            assert resp.status == 200
        async with http.post(f"{gw.url}/v1/chat/completions", data=b'{"model": "m", "messages": "' + secret.encode()
                             + b'", broken') as resp:
            assert resp.status == 400
    assert any("gateway.access" in r.name for r in caplog.records)
    assert secret not in caplog.text


async def test_header_size_limit_is_an_openai_431(gw, http):
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                         headers={"x-note": "a" * 10_000}) as resp:
        assert resp.status == 200  # under the default 16 KiB
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                         headers={"x-note": "a" * 20_000, "x-request-id": "big-1"}) as resp:
        assert resp.status == 431 and resp.headers["x-request-id"] == "big-1"
        assert_openai_error(await resp.json(), "headers_too_large")


async def test_compressed_bodies_reach_the_pod_decoded_and_bad_ones_are_refused(start_backend, start_gateway, http):
    import gzip
    import json
    import zlib

    import brotli

    from gateway.request.body import zstd

    received: list[tuple[bytes, str | None]] = []

    async def record(request: web.Request) -> web.Response:
        received.append((await request.read(), request.headers.get("content-encoding")))
        return web.json_response({"id": "ok", "choices": []})

    gw = await start_gateway([await start_backend(backend(record))], server={"max_body_bytes": 4096})
    body = json.dumps(chat_body(model="m")).encode()
    codecs = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress, "zstd": zstd.compress,
              "gzip, br": lambda b: brotli.compress(gzip.compress(b))}
    for encoding, encode in codecs.items():
        async with http.post(f"{gw.url}/v1/chat/completions", data=encode(body),
                             headers={"content-encoding": encoding, "content-type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
    # The pod gets the JSON itself, without the header that no longer describes it.
    assert received == [(body, None)] * len(codecs)
    cases = [("gzip", body[:20], 400, "invalid_body"), ("br", gzip.compress(body), 400, "invalid_body"),
             ("compress", body, 400, "unsupported_content_encoding"),
             ("gzip", gzip.compress(b" " * 1_000_000), 413, "request_too_large")]  # 1 MB of spaces in 1 kB
    for encoding, data, status, code in cases:
        for path in ("/v1/chat/completions", "/v1/messages"):
            async with http.post(f"{gw.url}{path}", data=data, headers={"content-encoding": encoding}) as resp:
                assert resp.status == status
                payload = await resp.json()
                if path == "/v1/messages":
                    assert payload["type"] == "error" and payload["error"]["type"]
                else:
                    assert_openai_error(payload, code)
    assert len(received) == len(codecs)


async def test_a_gzip_body_of_two_members_is_decoded_whole_and_bytes_after_the_last_are_refused(
        start_backend, start_gateway, http):
    import gzip
    import json

    received: list[bytes] = []

    async def record(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"id": "ok", "choices": []})

    gw = await start_gateway([await start_backend(backend(record))])
    body = json.dumps(chat_body(model="m")).encode()
    two_members = gzip.compress(body[:10]) + gzip.compress(body[10:])  # what `cat a.gz b.gz` makes
    async with http.post(f"{gw.url}/v1/chat/completions", data=two_members,
                         headers={"content-encoding": "gzip", "content-type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
    assert received == [body]
    for trailing in (b"garbage", b"\0\0\0\0"):
        async with http.post(f"{gw.url}/v1/chat/completions", data=gzip.compress(body) + trailing,
                             headers={"content-encoding": "gzip", "content-type": "application/json"}) as resp:
            assert resp.status == 400
            error = assert_openai_error(await resp.json(), "invalid_body")
            assert f"{len(trailing)} bytes after the end of the gzip data" in error["message"]
            assert resp.headers["x-should-retry"] == "false"
    assert received == [body]


async def test_a_pods_cookie_never_reaches_another_clients_request(start_backend, start_gateway):
    seen: list[str | None] = []

    async def sets_cookie(request: web.Request) -> web.Response:
        seen.append(request.headers.get("cookie"))
        response = web.json_response({"id": "x", "choices": []})
        response.set_cookie("session", "for-the-first-client-only")
        return response

    # By name, as pods in a cluster are (aiohttp's own jar ignores cookies of bare IP addresses).
    pod = (await start_backend(backend(sets_cookie))).replace("127.0.0.1", "localhost")
    gw = await start_gateway([pod])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as clients:  # clients that keep none
        for _ in range(2):
            async with clients.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
                assert resp.status == 200 and "set-cookie" in resp.headers.get("set-cookie", "set-cookie")
    assert seen == [None, None]  # the gateway kept no cookie of the pod's to send on


async def not_http_on_posts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A pod that lists model ``m`` (its health checks pass) but answers each POST with what is not HTTP (another
    service on its port, a mangled status line)."""
    models = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if not head.startswith(b"GET"):
                writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(models), models))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


async def test_a_pod_answering_what_is_not_http_fails_over_to_another_pod(start_backend, start_gateway, http, caplog):
    server = await asyncio.start_server(not_http_on_posts, "127.0.0.1", 0)
    bad = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        good = await start_backend(backend(ok))
        gw = await start_gateway([{"url": bad, "name": "bad"}, {"url": good, "name": "good"}],
                                 routing={"policy": "round_robin"})
        for _ in range(2):  # round robin: the bad pod is tried first at least once
            async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-gateway-pod"] == "good"
        counted = gw.kits.foundation.metrics.registry.get_sample_value("gateway_upstream_errors_total",
                                                               {"pod": "bad", "kind": "invalid_response"})
        assert counted >= 1
        assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no "unhandled error" traceback
        gw = await start_gateway([{"url": bad, "name": "bad"}])
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
            assert resp.status == 502  # the pod failed: not the gateway's own 500
            assert "invalid HTTP" in assert_openai_error(await resp.json(), "bad_gateway")["message"]
    finally:
        server.close()
