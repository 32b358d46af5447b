"""The Responses API's state at the gateway, proved with the clients' own wire shapes: a conversation as the
OpenAI Agents SDK sends it (``previous_response_id``, tool calls and their results as input items, streamed)
and one as Codex sends it (the whole history as input items, ``store`` false, its session headers), each
through two workers and two simulated pods; the stored responses' routes; the pods' own store
(``responses.store: pods``); Redis shared by two replicas."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from gateway.config import hash_api_key
from tests.integration.test_shared_state import FAST_BUS, pods_for, two_workers

MODEL = "mock-llama"
INSTRUCTIONS = "You are a careful agent with a weather tool. Answer in one line. " * 12
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CODEX = json.loads((Path(__file__).parents[1] / "fixtures" / "codex_responses_request.json").read_text())


@pytest.fixture
def sockets() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gw-", dir="/tmp")  # short: Unix socket paths are limited to 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def workers(start_mock_pod, start_gateway, run_dir: str, **config: Any) -> list[Any]:
    """Two workers of one gateway (each also on its private Unix socket, as ``serve --workers 2`` runs
    them) in front of two simulated pods, routing by ``kv_aware``."""
    pods = await pods_for(start_mock_pod, 2)
    gateways = [await start_gateway(pods, identity=identity, routing={"policy": "kv_aware"},
                                    shared_state=FAST_BUS, **config)
                for identity in two_workers(run_dir)]
    for gw in gateways:
        identity = gw.kits.foundation.identity
        await web.UnixSite(gw.runner, identity.http_socket(identity.index)).start()
    return gateways


async def streamed_turn(client: openai.AsyncOpenAI, **request: Any) -> tuple[str, Any]:
    """One streamed turn: the pod that answered and the completed response."""
    async with client.responses.with_streaming_response.create(model=MODEL, stream=True, **request) as raw:
        pod = raw.headers["x-gateway-pod"]
        kinds, final = [], None
        async for event in await raw.parse():
            kinds.append(event.type)
            if event.type == "response.completed":
                final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    return pod, final


async def test_an_agents_sdk_conversation_continues_through_any_worker(start_mock_pod, start_gateway, sockets):
    """Five turns of ``previous_response_id``, alternating between the workers: tool calls (the model's
    output), their results (the client's input items), and new questions. Every turn is served, on the pod
    holding the conversation, and finds the earlier turns cached there; no pod stores anything."""
    gateways = await workers(start_mock_pod, start_gateway, sockets)
    clients = [openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) for gw in gateways]
    turns: list[dict[str, Any]] = [
        {"input": "What is the weather in Paris?", "tool_choice": "required"},
        {"input": [{"type": "function_call_output", "output": "Sunny, 24 C."}]},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "And in Oslo?"}]}],
         "tool_choice": "required"},
        {"input": [{"type": "function_call_output", "output": "Rain, 9 C."}]},
        {"input": "Thanks. Which is warmer?"},
    ]
    previous, pods, cached, ids = None, [], [], []
    for i, turn in enumerate(turns):
        if previous is not None and previous.output[0].type == "function_call":
            turn["input"][0]["call_id"] = previous.output[0].call_id  # the tool's result answers the call
        pod, previous = await streamed_turn(clients[i % 2], instructions=INSTRUCTIONS, tools=TOOLS, max_output_tokens=6,
                                            previous_response_id=previous.id if previous else None, **turn)
        pods.append(pod)
        ids.append(previous.id)
        usage = previous.usage
        cached.append(usage.input_tokens_details.cached_tokens / usage.input_tokens)
        assert previous.output[0].type == ("function_call" if turn.get("tool_choice") == "required" else "message")
    assert len(set(pods)) == 1  # the conversation is a session: it stays with its cache
    assert min(cached[1:]) > 0.8, cached  # each turn found the earlier ones cached on the pod
    # Any worker answers for any response; the last one's input is the whole conversation, in order.
    for client in clients:
        assert (await client.responses.retrieve(ids[-1])).id == ids[-1]
    items = [item async for item in clients[0].responses.input_items.list(ids[-1], order="asc", limit=100)]
    assert [i.type for i in items] == ["message", "function_call", "function_call_output", "message", "message",
                                      "function_call", "function_call_output", "message", "message"]
    for client in clients:
        await client.close()


async def test_a_codex_conversation_sends_its_history_and_stays_with_its_cache(start_mock_pod, start_gateway, sockets,
                                                                              http):
    """Codex sends the whole history as input items every turn, ``store`` false, with its session headers
    (``session-id``, ``thread-id``) and ``prompt_cache_key``: the gateway passes it as it is, keeps nothing,
    and the session stays on the pod holding its cache."""
    gateways = await workers(start_mock_pod, start_gateway, sockets)
    body = {**CODEX["body"], "input": CODEX["body"]["input"][:4]}
    pods, cached = [], []
    for turn in range(3):
        gw = gateways[turn % 2]
        async with http.post(f"{gw.url}/v1/responses", json=body, headers=CODEX["headers"]) as resp:
            assert resp.status == 200, await resp.text()
            pods.append(resp.headers["x-gateway-pod"])
            events = [json.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: ")]
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and final["status"] == "incomplete"
        usage = final["usage"]
        cached.append(usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"])
        async with http.get(f"{gw.url}/v1/responses/{final['id']}") as resp:
            assert resp.status == 404  # store false: nothing kept
        body = {**body, "input": [*body["input"], *final["output"],
                                  {"type": "message", "role": "user",
                                   "content": [{"type": "input_text", "text": f"Next step {turn}."}]}]}
    assert len(set(pods)) == 1 and min(cached[1:]) > 0.8, (pods, cached)


async def test_stored_responses_routes(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], auth={"api_key_hashes": [hash_api_key("sk-a"), hash_api_key("sk-b")]})
    a = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-a", max_retries=0)
    b = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-b", max_retries=0)
    first = await a.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    second = await a.responses.create(model=MODEL, input="Again", max_output_tokens=3, previous_response_id=first.id)
    assert (await a.responses.retrieve(second.id)).output_text == second.output_text
    page = await a.responses.input_items.list(second.id, limit=2)  # newest first
    assert [i.content[0].text for i in page.data] == ["Again", first.output_text] and page.has_more
    later = await a.responses.input_items.list(second.id, limit=2, after=page.data[-1].id)
    assert [i.content[0].text for i in later.data] == ["Hello"] and not later.has_more
    # Another key reads none of them, nor continues them.
    with pytest.raises(openai.NotFoundError):
        await b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await b.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as cancel:
        await a.responses.cancel(first.id)
    assert cancel.value.body["message"] == "Cannot cancel a synchronous response."
    await a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await a.responses.delete(first.id)
    counted = gw.kits.foundation.metrics.registry.get_sample_value
    assert [counted("gateway_responses_total", {"event": e}) for e in ("stored", "deleted")] == [2, 1]
    unstored = await a.responses.create(model=MODEL, input="Hello", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(unstored.id)
    async with http.post(f"{gw.url}/v1/responses", json={"model": MODEL, "input": "x", "background": True},
                         headers={"authorization": "Bearer sk-a"}) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "background" and error["code"] == "unsupported_parameter"
    async with http.get(f"{gw.url}/v1/responses/{second.id}") as resp:
        assert resp.status == 401
    await a.close()
    await b.close()


async def test_with_the_pods_store_a_conversation_goes_to_the_pod_that_keeps_it(start_mock_pod, start_gateway, http):
    pods = [await start_mock_pod(responses_store=True) for _ in range(2)]
    gw = await start_gateway([p.url for p in pods], responses={"store": "pods"})  # round robin
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    raw = await client.responses.with_raw_response.create(model=MODEL, input="Hello", max_output_tokens=3)
    first, keeper = raw.parse(), raw.headers["x-gateway-pod"]
    for _ in range(3):  # round robin would take every other one elsewhere
        raw = await client.responses.with_raw_response.create(model=MODEL, input="Again", max_output_tokens=3,
                                                              previous_response_id=first.id)
        assert raw.headers["x-gateway-pod"] == keeper and raw.parse().previous_response_id == first.id
    async with http.get(f"{gw.url}/v1/responses/{first.id}") as resp:
        assert resp.status == 200 and resp.headers["x-gateway-pod"] == keeper
        assert (await resp.json())["id"] == first.id
    with pytest.raises(openai.BadRequestError) as cancel:  # vLLM's own refusal, in OpenAI's shape
        await client.responses.cancel(first.id)
    assert cancel.value.code is None and cancel.value.param == "response_id"
    async with http.delete(f"{gw.url}/v1/responses/{first.id}") as resp:
        assert resp.status == 501 and "do not delete" in (await resp.json())["error"]["message"]
    await client.close()


async def test_replicas_sharing_redis_continue_each_others_conversations(start_mock_pod, start_gateway, redis_server):
    pod = await start_mock_pod()
    shared = {"redis_url": redis_server.url, **FAST_BUS}
    replicas = [await start_gateway([pod.url], shared_state=shared, responses={"ttl_s": 60}) for _ in range(2)]
    clients = [openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) for gw in replicas]
    previous = None
    for turn in range(4):
        previous = await clients[turn % 2].responses.create(
            model=MODEL, input=f"Turn {turn}", max_output_tokens=3,
            previous_response_id=previous.id if previous else None)
    assert (await clients[0].responses.retrieve(previous.id)).id == previous.id
    for client in clients:
        await client.close()



async def test_a_continued_requests_numbers_reach_the_pod_as_sent_or_are_a_400(start_backend, start_gateway, http):
    """The body is rewritten into the whole conversation: a big integer (in a field the gateway does not
    read: its ``seed`` is a 64-bit one) reaches the pod exactly as sent, and a number out of a double's range
    is refused in OpenAI's shape (not a 500)."""
    bodies: list[bytes] = []

    async def answer(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.json_response({"id": f"resp_{len(bodies)}", "object": "response", "output": []})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_post("/v1/responses", answer)
    app.router.add_get("/v1/models", models)
    gw = await start_gateway([await start_backend(app)])
    first = b'{"model": "%s", "input": "Hi"}' % MODEL.encode()
    continued = b'{"model": "%s", "input": "Again", "previous_response_id": "resp_1", %s}'
    for body, status in ((first, 200), (continued % (MODEL.encode(), b'"x_seed": 123456789012345678901234567890'), 200),
                         (continued % (MODEL.encode(), b'"x": 1e999'), 400)):
        async with http.post(f"{gw.url}/v1/responses", data=body, headers={"content-type": "application/json"}) as resp:
            assert resp.status == status, await resp.text()
            if status == 400:
                assert (await resp.json())["error"]["type"] == "invalid_request_error"
    assert len(bodies) == 2 and b'"x_seed":123456789012345678901234567890' in bodies[-1], bodies


async def test_a_response_a_pods_store_replica_recorded_is_a_404_where_the_gateway_keeps_them(
        start_mock_pod, start_gateway, redis_server, http):
    """Replicas sharing Redis while ``responses.store`` changes from pods to gateway: a record of the pods'
    store holds no conversation, so the gateway's store answers for it as for one it does not hold."""
    pod = await start_mock_pod(responses_store=True)
    shared = {"redis_url": redis_server.url, **FAST_BUS}
    old, new = [await start_gateway([pod.url], shared_state=shared, responses={"store": store})
                for store in ("pods", "gateway")]
    async with http.post(f"{old.url}/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}) as r:
        first = (await r.json())["id"]
    continued = {"model": MODEL, "input": "Again", "max_output_tokens": 2, "previous_response_id": first}
    async with http.post(f"{new.url}/v1/responses", json=continued) as resp:
        assert resp.status == 404, await resp.text()
        assert (await resp.json())["error"]["param"] == "previous_response_id"
    for path in (f"/v1/responses/{first}", f"/v1/responses/{first}/input_items"):
        async with http.get(new.url + path) as resp:
            assert resp.status == 404, (path, await resp.text())


async def test_a_deletion_the_shared_store_fails_is_a_503(start_mock_pod, start_gateway, redis_server, http):
    """The store answers the lookup, then fails the deletion (here: a Redis user that may not DEL): the
    client gets the store's 503 in OpenAI's shape, as for a lookup it fails, and the response stays."""
    import redis.asyncio as redis

    admin = redis.from_url(redis_server.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all", "-del", "-unlink")
    await admin.aclose()
    url = redis_server.url.replace("redis://", "redis://gw:pw@")
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], shared_state={"redis_url": url, **FAST_BUS})
    async with http.post(f"{gw.url}/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}) as r:
        first = (await r.json())["id"]
    async with http.delete(f"{gw.url}/v1/responses/{first}") as resp:
        assert resp.status == 503, await resp.text()
        assert (await resp.json())["error"]["code"] == "store_unavailable"
    async with http.get(f"{gw.url}/v1/responses/{first}") as resp:
        assert resp.status == 200


async def test_with_the_pods_store_a_background_response_streams_from_its_pod(start_backend, start_gateway, http):
    """``GET /v1/responses/{id}?stream=true`` of a background response (vLLM answers its events as they
    come): each event reaches the client as the pod sends it, as a stream."""
    more = asyncio.Event()

    async def create(request: web.Request) -> web.Response:
        return web.json_response({"id": "resp_bg", "object": "response", "status": "queued", "output": []})

    async def retrieve(request: web.Request) -> web.StreamResponse:
        assert request.query["stream"] == "true"
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: response.in_progress\ndata: {"sequence_number": 0}\n\n')
        await more.wait()  # the background response is still running
        await resp.write(b'event: response.completed\ndata: {"sequence_number": 1}\n\n')
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_get("/v1/models", models)
    gw = await start_gateway([await start_backend(app)], responses={"store": "pods"})
    async with http.post(f"{gw.url}/v1/responses", json={"model": MODEL, "input": "Hi", "background": True}) as resp:
        assert resp.status == 200 and (await resp.json())["id"] == "resp_bg"
    async with http.get(f"{gw.url}/v1/responses/resp_bg?stream=true") as resp:
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/event-stream")
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first.startswith(b"event: response.in_progress\n")
        more.set()
        assert (await resp.read()).startswith(b"event: response.completed\n")
