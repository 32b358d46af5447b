"""What a client is told about retrying, by a real gateway process: refusals a retry cannot fix say
``x-should-retry: false``; a 503 with no healthy pod says ``true`` and a Retry-After from how soon a pod
may be back (its health checks), and ``false`` to an SDK's retry of it (one retry a call while no pod serves the
model); the official SDKs at their default retries follow both. Connections that
send their headers too slowly are cut off."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest

from bench.metrics_text import sample_sum
from gateway.config import hash_api_key
from gateway.http_errors import NO_POD_RETRIES
from simulator.pod import free_port
from tests.conftest import chat_body, gateway_process
from tests.integration.test_records import requests_total

INTERVAL_S, SUCCESS_THRESHOLD = 0.5, 4  # a pod that is down needs 4 passing checks: ~2 s to be back
MESSAGES = [{"role": "user", "content": "hi"}]
LINES = 100  # header lines a slow client sends, one each 0.2 s


@pytest.fixture(scope="module")
def down(tmp_path_factory: pytest.TempPathFactory):
    """A gateway (one worker) with API keys and one pod that never answers (nothing listens on its port)."""
    config = {
        "pods": [{"url": f"http://127.0.0.1:{free_port()}", "models": ["m"]}],
        "health": {"interval_s": INTERVAL_S, "success_threshold": SUCCESS_THRESHOLD},
        "auth": {"keys": [{"hash": hash_api_key("sk-user"), "models": ["m"]}],
                 "admin_key_hashes": [hash_api_key("sk-admin")]},
        "server": {"max_body_bytes": 4096, "workers": 1, "header_read_timeout_s": 2},
    }
    path: Path = tmp_path_factory.mktemp("down") / "gateway.json"
    path.write_text(json.dumps(config))
    with gateway_process("--config", str(path), ready_path="/healthz") as gw:
        yield gw


def user(key: str = "sk-user") -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_refusals_a_retry_cannot_fix_say_so(down, http):
    chat, messages = f"{down.url}/v1/chat/completions", f"{down.url}/v1/messages"
    refusals = [
        ("POST", chat, {"json": chat_body(model="m"), "headers": user("sk-wrong")}, 401),
        ("POST", messages, {"json": {"model": "m", "max_tokens": 5, "messages": MESSAGES},
                            "headers": {"x-api-key": "sk-wrong"}}, 401),
        ("POST", chat, {"data": b"{not json", "headers": user()}, 400),
        ("POST", messages, {"data": b"{not json", "headers": user()}, 400),
        ("POST", chat, {"json": chat_body(model="other"), "headers": user()}, 403),
        ("POST", chat, {"data": b"x" * 8192, "headers": user()}, 413),
        ("POST", chat, {"json": chat_body(model="m"), "headers": {**user(), "x-big": "a" * 20_000}}, 431),
        ("GET", f"{down.url}/v1/nowhere", {"headers": user()}, 404),
        ("GET", chat, {"headers": user()}, 405),
    ]
    for method, url, kwargs, status in refusals:
        async with http.request(method, url, **kwargs) as resp:
            assert resp.status == status, (url, await resp.text())
            assert resp.headers.get("x-should-retry") == "false", (status, dict(resp.headers))
            assert "retry-after" not in resp.headers


async def test_no_healthy_pod_says_retry_after_the_pods_next_passing_checks(down, http):
    back_in = math.ceil(INTERVAL_S * SUCCESS_THRESHOLD)  # the next check, then 3 more passing ones
    for url, body in ((f"{down.url}/v1/chat/completions", chat_body(model="m")),
                      (f"{down.url}/v1/messages", {"model": "m", "max_tokens": 5, "messages": MESSAGES})):
        async with http.post(url, json=body, headers=user()) as resp:
            assert resp.status == 503, await resp.text()
            assert resp.headers["x-should-retry"] == "true"
            # Not a constant: from the health interval and the passing checks the pod still needs.
            assert 1 < int(resp.headers["retry-after"]) <= back_in, dict(resp.headers)


async def test_the_admin_key_is_a_key_for_the_api_too(down, http):
    async with http.post(f"{down.url}/v1/chat/completions", json=chat_body(model="m"),
                         headers=user("sk-admin")) as resp:
        assert resp.status == 503  # let through (no pod serves it now), not 401
    async with http.get(f"{down.url}/v1/models", headers={"x-api-key": "sk-admin"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"] == []  # m's only pod is down: nothing to list


async def gateway_requests(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/metrics", headers=user("sk-admin")) as resp:
        text = await resp.text()
    return int(sample_sum(text, "gateway_requests_total", model="m"))


async def test_sdk_clients_at_default_retries_make_one_retry_while_no_pod_serves_the_model(down, http):
    """4 clients (2 OpenAI, 2 Anthropic), at their default ``max_retries`` (2), one call each against a model
    with no healthy pod: each call is its request and one retry after the Retry-After, whose 503 says not to
    retry again (without the budget each call was 3 requests)."""
    clients = [openai.AsyncOpenAI(base_url=f"{down.url}/v1", api_key="sk-user") for _ in range(2)]
    anthropics = [anthropic.AsyncAnthropic(base_url=down.url, api_key="sk-user") for _ in range(2)]
    calls = [c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5) for c in clients]
    calls += [c.messages.create(model="m", max_tokens=5, messages=MESSAGES) for c in anthropics]
    before = await gateway_requests(http, down.url)
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, openai.InternalServerError | anthropic.InternalServerError) and r.status_code == 503
               for r in results), results
    assert all(r.response.headers["x-should-retry"] == "false" for r in results)  # the retry's answer
    sent = await gateway_requests(http, down.url) - before
    assert anthropics[0].max_retries == clients[0].max_retries == 2  # the SDKs' defaults
    assert sent == (1 + NO_POD_RETRIES) * len(results), sent


async def test_a_client_that_does_not_number_its_retries_is_told_to_retry_each_time(down, http):
    for headers in ({}, {"x-stainless-retry-count": "0"}, {"x-stainless-retry-count": "many"}):
        async with http.post(f"{down.url}/v1/chat/completions", json=chat_body(model="m"),
                             headers={**user(), **headers}) as resp:
            assert resp.status == 503 and resp.headers["x-should-retry"] == "true", headers


async def test_slow_headers_are_cut_off_and_other_clients_are_served(down, http):
    def slow_client() -> tuple[int, bytes]:
        """Headers sent a line every 0.2 s: how many lines went out before the gateway answered and closed."""
        with socket.create_connection(("127.0.0.1", int(down.url.rsplit(":", 1)[1]))) as sock:
            sock.settimeout(0.2)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n")
            answer = b""
            # 20 s of headers, 10x this gateway's timeout (and fewer lines than aiohttp's own limit on them)
            for line in range(LINES):
                try:
                    sock.sendall(b"X-Slow-%d: yes\r\n" % line)
                    chunk = sock.recv(4096)
                except TimeoutError:
                    continue
                except OSError:  # reset: the gateway closed it
                    return line, answer
                if not chunk:
                    return line, answer
                answer += chunk
            return LINES, answer

    slow = [asyncio.to_thread(slow_client) for _ in range(5)]
    async with http.get(f"{down.url}/healthz") as resp:
        assert resp.status == 200
    for lines, answer in await asyncio.gather(*slow):
        assert lines < LINES, "a client sending headers slowly kept its connection"
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"code":"header_timeout"' in answer
    async with http.get(f"{down.url}/metrics", headers=user("sk-admin")) as resp:  # each 408 recorded, as sent
        per_status, _, _ = requests_total(await resp.text())
    assert per_status[408] == 5, per_status
