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
    registry = gw.gateway.pods
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
    assert {v.pod for v in gw.gateway.kv.index.views()} == {"pod0", "pod1"}  # subscribers started
    pods_file.write_text('{"pods": [{"url": "not-a-url"}]}')  # a bad edit is ignored: the last good set stays
    await asyncio.sleep(0.3)
    assert {p.name for p in registry.all()} == {"pod0", "pod1"}
    write_pods(pods_file, [(1, b)])
    await eventually(lambda: [p.name for p in registry.all()] == ["pod1"])
    assert await served_by() == {"pod1"}
    assert {v.pod for v in gw.gateway.kv.index.views()} == {"pod1"}  # pod0's index and subscriber gone
