"""Request hooks through a real gateway, configured by the worked example of docs/routing.md ("A request
hook"): the pre-request hook's headers reach the pod that serves the request, and the response-complete hook
sees the pod, status, outcome and usage of the request as it was served, a pod's error and a client that
left mid-stream included; a hook that raises fails nothing and is counted."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from plugins.hooks.routing_headers import RoutingHeaders
from plugins.hooks.usage_log import UsageLog
from tests.conftest import chat_body, eventually, models_of

DOCS = Path(__file__).resolve().parents[2] / "docs/routing.md"
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def docs_hooks() -> dict[str, Any]:
    """The ``hooks`` block of docs/routing.md's worked example, as written."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOCS.read_text(), flags=re.S | re.M)
    return yaml.safe_load(next(b for b in blocks if b.startswith("hooks:")))


def pod_app(seen: list[dict[str, str]], *, status: int = 200, endless: bool = False) -> web.Application:
    """A pod that records each request's headers and answers ``status`` with usage (or streams forever)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        if endless:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            while True:
                await resp.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
                await asyncio.sleep(0.05)
        if status != 200:
            return web.json_response({"error": {"message": "engine died", "type": "server_error"}}, status=status)
        return web.json_response({"id": "c1", "object": "chat.completion", "model": "m", "usage": USAGE,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                               "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models_of("m"))
    return app


@pytest.fixture
def usage_lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """What the ``usage_log`` hook of the docs' example writes (``.records``), as it writes it."""
    caplog.set_level(logging.INFO, logger=docs_hooks()["hooks"]["response_complete"][0]["options"]["logger"])
    return caplog


async def gateway_with_hooks(start_backend, start_gateway, app: web.Application) -> Any:
    gw = await start_gateway([{"url": await start_backend(app), "name": "a"}], **docs_hooks())
    await gw.serving("m")
    return gw


async def usage_of(lines: pytest.LogCaptureFixture, request_id: str) -> logging.LogRecord:
    """The usage line of request ``request_id``, once written (after the answer ended)."""

    def line() -> logging.LogRecord | None:
        return next((r for r in lines.records if r.name == "gateway.usage" and r.request_id == request_id), None)

    await eventually(lambda: line() is not None)
    return line()


async def test_the_pod_gets_the_hooks_headers_and_the_usage_log_sees_the_request_it_served(
        start_backend, start_gateway, http, usage_lines):
    seen: list[dict[str, str]] = []
    gw = await gateway_with_hooks(start_backend, start_gateway, pod_app(seen))
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                         headers={"x-request-id": "served-1"}) as resp:
        assert resp.status == 200
    (headers,) = seen
    assert (headers["x-gateway-routing-policy"], headers["x-gateway-routing-reason"]) == ("round_robin",
                                                                                         "rotation")
    line = await usage_of(usage_lines, "served-1")
    assert (line.pod, line.status, line.outcome, line.prompt_tokens, line.completion_tokens) == (
        "a", 200, "ok", 7, 3)
    assert line.ttfb_ms is not None and line.duration_ms >= line.ttfb_ms
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_routing_plugin_seconds_count{kind="pre_request",plugin="routing_headers"} 1.0' in metrics
    assert 'gateway_routing_plugin_seconds_count{kind="response_complete",plugin="usage_log"} 1.0' in metrics


async def test_a_pods_error_is_seen_as_the_client_got_it(start_backend, start_gateway, http, usage_lines):
    seen: list[dict[str, str]] = []
    gw = await gateway_with_hooks(start_backend, start_gateway, pod_app(seen, status=500))
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m"),
                         headers={"x-request-id": "failed-1"}) as resp:
        assert resp.status >= 500
    assert seen and all("x-gateway-routing-reason" in h for h in seen)
    line = await usage_of(usage_lines, "failed-1")
    assert (line.pod, line.status, line.outcome, line.prompt_tokens) == ("a", resp.status, "error", None)


async def test_a_client_that_left_mid_stream_is_seen_as_gone(start_backend, start_gateway, http, usage_lines):
    seen: list[dict[str, str]] = []
    gw = await gateway_with_hooks(start_backend, start_gateway, pod_app(seen, endless=True))
    resp = await http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m", stream=True),
                           headers={"x-request-id": "left-1"})
    assert (await resp.content.readany()).startswith(b"data: ")
    resp.close()  # the client hangs up mid-stream
    line = await usage_of(usage_lines, "left-1")
    assert (line.pod, line.status, line.outcome) == ("a", 200, "client_gone")


async def test_hooks_that_raise_fail_nothing_and_are_counted(start_backend, start_gateway, http, monkeypatch):
    def boom(self: object, view: object) -> None:
        raise RuntimeError("a hook's own bug")

    monkeypatch.setattr(RoutingHeaders, "pre_request", boom)
    monkeypatch.setattr(UsageLog, "response_complete", boom)
    seen: list[dict[str, str]] = []
    gw = await gateway_with_hooks(start_backend, start_gateway, pod_app(seen))
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m")) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"] == USAGE
    assert "x-gateway-routing-reason" not in seen[0]
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_request_hook_errors_total{hook="routing_headers",kind="pre_request"} 1.0' in metrics
    assert 'gateway_request_hook_errors_total{hook="usage_log",kind="response_complete"} 1.0' in metrics
