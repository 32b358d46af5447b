"""Pods discovered at runtime from a watched file: added, served, removed, with their KV subscribers."""

from __future__ import annotations

import asyncio
import json

import msgspec

from tests.integration.test_kv_subscriber import eventually


def write_pods(path, pods) -> None:
    path.write_text(json.dumps({"pods": [msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"}
                                         for i, p in pods]}))


async def test_file_discovery_adds_and_removes_pods(start_mock_pod, start_gateway, http, tmp_path):
    a, b = await start_mock_pod(), await start_mock_pod()
    pods_file = tmp_path / "pods.json"
    write_pods(pods_file, [(0, a)])
    gw = await start_gateway([], discovery={"source": "file", "options": {"path": str(pods_file), "interval_s": 0.05}})
    registry = gw.kits.foundation.pods
    await eventually(lambda: [p.name for p in registry.all()] == ["pod0"] and registry.all()[0].healthy)
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}

    async def served_by() -> set[str]:
        seen = set()
        for _ in range(6):
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                seen.add(resp.headers["x-gateway-pod"])
        return seen

    assert await served_by() == {"pod0"}
    write_pods(pods_file, [(0, a), (1, b)])
    await eventually(lambda: {p.name for p in registry.all() if p.healthy} == {"pod0", "pod1"})
    assert await served_by() == {"pod0", "pod1"}
    assert {v.pod for v in gw.kits.kv.index.views()} == {"pod0", "pod1"}  # subscribers started
    pods_file.write_text('{"pods": [{"url": "not-a-url"}]}')  # a bad edit is ignored: the last good set stays
    await asyncio.sleep(0.3)
    assert {p.name for p in registry.all()} == {"pod0", "pod1"}
    write_pods(pods_file, [(1, b)])
    await eventually(lambda: [p.name for p in registry.all()] == ["pod1"])
    assert await served_by() == {"pod1"}
    assert {v.pod for v in gw.kits.kv.index.views()} == {"pod1"}  # pod0's index and subscriber gone
    metrics = gw.kits.foundation.metrics.render().decode()  # its gauges went with it
    for gauge in ("gateway_in_flight_requests", "gateway_pod_pending_load", "gateway_pod_kv_usage",
                  "gateway_pod_healthy"):
        assert f'{gauge}{{pod="pod1"}}' in metrics and f'{gauge}{{pod="pod0"}}' not in metrics
    assert 'gateway_pod_role{pod="pod1",role="both"} 1.0' in metrics and 'gateway_pod_role{pod="pod0"' not in metrics


class FakeKubeApi:
    """A local API server speaking the real list + watch protocol (chunked JSON lines) for pods."""

    def __init__(self) -> None:
        from aiohttp import web

        self.items: dict[str, dict] = {}
        self.version = 1
        self.events: asyncio.Queue[dict] = asyncio.Queue()
        self.tokens: list[str | None] = []
        self.app = web.Application()
        self.app.router.add_get("/api/v1/namespaces/llm/pods", self.pods)

    async def pods(self, request):
        from aiohttp import web

        self.tokens.append(request.headers.get("authorization"))
        assert request.query["labelSelector"] == "app=vllm"
        if request.query.get("watch") != "1":
            return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": str(self.version)},
                                      "items": list(self.items.values())})
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        while True:
            event = await self.events.get()
            await resp.write(json.dumps(event).encode() + b"\n")

    def pod_object(self, name: str, mock, ready: bool = True) -> dict:
        port = mock.port
        events = mock.publisher.endpoint.rsplit(":", 1)[1]
        replay = mock.publisher.replay_endpoint.rsplit(":", 1)[1]
        return {"metadata": {"name": name, "annotations": {
                    "gateway.kv/http-port": str(port), "gateway.kv/kv-events-port": events,
                    "gateway.kv/kv-replay-port": replay, "gateway.kv/model": "mock-llama"}},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    def push(self, kind: str, obj: dict) -> None:
        self.version += 1
        self.events.put_nowait({"type": kind, "object": obj})


async def test_kubernetes_discovery_follows_the_watch(start_mock_pod, start_backend, start_gateway, http, tmp_path):
    a, b = await start_mock_pod(), await start_mock_pod()
    api = FakeKubeApi()
    api.items["vllm-0"] = api.pod_object("vllm-0", a)
    api.items["vllm-1"] = api.pod_object("vllm-1", b, ready=False)  # not ready: no traffic
    server = await start_backend(api.app)
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    gw = await start_gateway([], discovery={"source": "kubernetes", "options": {
        "api_server": server, "namespace": "llm", "label_selector": "app=vllm", "token_path": str(token)}})
    registry = gw.kits.foundation.pods
    await eventually(lambda: [p.name for p in registry.all()] == ["vllm-0"] and registry.all()[0].healthy)
    assert registry.all()[0].config.kv_events == a.publisher.endpoint and api.tokens[0] == "Bearer sa-token"
    api.push("MODIFIED", api.pod_object("vllm-1", b, ready=True))
    await eventually(lambda: {p.name for p in registry.all() if p.healthy} == {"vllm-0", "vllm-1"})
    assert {v.pod for v in gw.kits.kv.index.views()} == {"vllm-0", "vllm-1"}
    api.push("DELETED", api.pod_object("vllm-0", a))
    await eventually(lambda: [p.name for p in registry.all()] == ["vllm-1"])
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["x-gateway-pod"] == "vllm-1"
    calls = len(api.tokens)
    api.items = {"vllm-1": api.pod_object("vllm-1", b)}
    api.push("ERROR", {"kind": "Status", "code": 410, "message": "too old resource version"})
    await eventually(lambda: len(api.tokens) >= calls + 2, within_s=10)  # listed and watched again
    assert [p.name for p in registry.all()] == ["vllm-1"]
