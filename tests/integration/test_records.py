"""Every request recorded once, as the client saw it: ``gateway_requests_total`` and the access log against what
a client was answered, over every route and every refusal, the server's own before any handler included."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import hash_api_key
from gateway.logs import ACCESS_LOGGER
from simulator.pod import free_port
from tests.conftest import chat_body, models_of

KEY = {"Authorization": "Bearer sk-good"}
WRONG_KEY = {"Authorization": "Bearer sk-wrong"}
MAX_BODY = 4096


async def raw_status(port: int, request: bytes) -> int:
    """The status of an answer to bytes written as they are (what an HTTP client would refuse to send)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout=30)
        return int(line.split()[1])
    finally:
        writer.close()


def too_many_headers() -> bytes:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(300))
    return b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"


CL_AND_TE = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n"
             b"\r\n0\r\n\r\n")


class Client:
    """Sends requests and tallies the status each was answered with."""

    def __init__(self, http: aiohttp.ClientSession, url: str, port: int) -> None:
        self.http, self.url, self.port = http, url, port
        self.sent: Counter[int] = Counter()

    async def call(self, method: str, path: str, **kwargs: object) -> aiohttp.ClientResponse:
        async with self.http.request(method, self.url + path, **kwargs) as resp:  # type: ignore[arg-type]
            await resp.read()
            self.sent[resp.status] += 1
            return resp

    async def stream(self, body: dict, **kwargs: object) -> bytes:
        async with self.http.post(self.url + "/v1/chat/completions", json=body, headers=KEY, **kwargs) as resp:
            self.sent[resp.status] += 1
            return await resp.read()

    async def raw(self, request: bytes) -> int:
        status = await raw_status(self.port, request)
        self.sent[status] += 1
        return status


async def wait_ready(client: Client, proc: asyncio.subprocess.Process) -> None:
    """Until ``/readyz`` says ready; each answer it gets is a request like any other."""
    for _ in range(600):
        assert proc.returncode is None, "gateway exited during start-up"
        try:
            if (await client.call("GET", "/readyz")).status == 200:
                return
        except aiohttp.ClientConnectionError:
            pass  # not listening yet: nothing was answered
        await asyncio.sleep(0.1)
    raise AssertionError("gateway never became ready")


def requests_total(text: str) -> tuple[Counter[int], Counter[str], set[str]]:
    """``gateway_requests_total`` summed per status, and per outcome; the values of its other labels."""
    per_status: Counter[int] = Counter()
    per_outcome: Counter[str] = Counter()
    labels: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_requests_total":
                per_status[int(sample.labels["status"])] += int(sample.value)
                per_outcome[sample.labels["outcome"]] += int(sample.value)
                labels.update(sample.labels[name] for name in ("model", "pod", "route"))
    return per_status, per_outcome, labels


async def test_every_answer_is_recorded_once_with_the_status_the_client_saw(start_mock_pod, http, tmp_path: Path):
    pod = await start_mock_pod()
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "pods": [{"url": pod.url}], "health": {"interval_s": 0.2},
        "auth": {"api_key_hashes": [hash_api_key("sk-good")]},
        "server": {"max_body_bytes": MAX_BODY}, "logging": {"json": True, "access_log": True},
    }))
    log = tmp_path / "gateway.log"
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port), stderr=stderr)
    client = Client(http, f"http://127.0.0.1:{port}", port)
    try:
        await wait_ready(client, proc)
        chat = chat_body(model="mock-llama", max_tokens=5)
        assert (await client.call("POST", "/v1/chat/completions", json=chat, headers=KEY)).status == 200
        assert b"[DONE]" in await client.stream({**chat, "stream": True})
        assert (await client.call("GET", "/v1/models", headers=KEY)).status == 200
        async with http.post(f"{client.url}/v1/responses", headers=KEY,
                             json={"model": "mock-llama", "input": "hi", "max_output_tokens": 5}) as resp:
            client.sent[resp.status] += 1
            response_id = (await resp.json())["id"]
        assert (await client.call("GET", f"/v1/responses/{response_id}", headers=KEY)).status == 200
        assert (await client.call("DELETE", f"/v1/responses/{response_id}", headers=KEY)).status == 200
        assert (await client.call("GET", f"/v1/responses/{response_id}", headers=KEY)).status == 404
        assert (await client.call("DELETE", f"/v1/responses/{response_id}", headers=KEY)).status == 404
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", f"/v1/responses/{response_id}")):
            assert (await client.call(method, path, json=chat, headers=WRONG_KEY)).status == 401
        assert (await client.call("GET", "/no/such/route", headers=KEY)).status == 404
        assert (await client.call("GET", "/v1/chat/completions", headers=KEY)).status == 405
        big = {**chat, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
        assert (await client.call("POST", "/v1/chat/completions", json=big, headers=KEY)).status == 413
        assert (await client.call("GET", "/v1/models", headers={**KEY, "x-big": "x" * 20_000})).status == 431
        assert await client.raw(too_many_headers()) == 400
        assert await client.raw(CL_AND_TE) == 400
        assert (await client.call("POST", "/v1/chat/completions", data=b"{not json", headers=KEY)).status == 400
        unknown = {**chat, "model": "m" * 3000}  # a client's name: never a label
        assert (await client.call("POST", "/v1/chat/completions", json=unknown, headers=KEY)).status == 404
        for fault in ("engine_error_fraction", "malformed_event_fraction"):
            await http.post(f"{pod.url}/debug/faults", json={fault: 1.0})
            body = await client.stream({**chat, "stream": True})
            assert b'data: {"error"' in body and b"not json" not in body
        await http.post(f"{pod.url}/debug/faults", json={})
        async with http.get(f"{client.url}/metrics") as resp:  # recorded once answered: not in its own count
            per_status, per_outcome, labels = requests_total(await resp.text())
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), timeout=60) == 0
    finally:
        if proc.returncode is None:  # SIGTERM first: the supervisor stops its workers
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    logged = Counter(line["status"] for line in lines if line["logger"] == ACCESS_LOGGER)
    print(f"sent {dict(sorted(client.sent.items()))}; counted {dict(sorted(per_status.items()))}; "
          f"logged {dict(sorted(logged.items()))} (the last scrape's line included); outcomes {dict(per_outcome)}",
          file=sys.stderr)
    assert per_status == client.sent
    assert logged == client.sent + Counter({200: 1})
    assert per_outcome["engine_error"] == per_outcome["malformed"] == 1
    # Bounded labels: the model the pods serve or "unknown", route templates or "unmatched", never a path.
    assert {"mock-llama", "unknown", "unmatched", "/v1/responses/{response_id}"} <= labels
    assert not any(response_id in value or "no/such" in value or len(value) > 64 for value in labels)
    assert {s: n for s, n in client.sent.items() if s >= 400} == {400: 3, 401: 3, 404: 4, 405: 1, 413: 1, 431: 1}



async def test_engine_errors_inside_streams_count_against_the_pod_as_5xx_answers_do(start_mock_pod, start_gateway,
                                                                                    http):
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], health={"interval_s": 60, "eject_after_5xx": 2})
    await gw.serving("mock-llama")
    chat = chat_body(model="mock-llama", max_tokens=5, stream=True)
    for fault in ("engine_error_fraction", "malformed_event_fraction"):
        await http.post(f"{pod.url}/debug/faults", json={fault: 1.0})
        async with http.post(f"{gw.url}/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
            await resp.read()
    (served,) = gw.kits.foundation.pods.all()
    assert served.ejections == 1 and "malformed_event" in (served.last_error or "")
    registry = gw.kits.foundation.metrics.registry
    for kind in ("engine_error", "malformed_event"):
        assert registry.get_sample_value("gateway_upstream_errors_total", {"pod": served.name, "kind": kind}) == 1


async def test_a_malformed_event_on_anthropics_route_ends_with_anthropics_error_event(start_backend, start_gateway,
                                                                                      http):
    async def messages(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: message_start\ndata: {"type": "message_start"}\n\nevent: ping\ndata: {oops\n\n')
        await resp.write(b'event: message_stop\ndata: {"type": "message_stop"}\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models_of("m"))
    gw = await start_gateway([await start_backend(app)])
    await gw.serving("m")
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{gw.url}/v1/messages", json=body) as resp:
        assert resp.status == 200
        received = await resp.read()
    first, last = received.split(b"\n\n")[0], received.split(b"\n\n")[-2]
    assert first.startswith(b"event: message_start") and b"oops" not in received and b"message_stop" not in received
    assert last.startswith(b"event: error\ndata: ")
    assert json.loads(last.split(b"data: ", 1)[1])["type"] == "error"
