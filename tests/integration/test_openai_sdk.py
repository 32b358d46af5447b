"""The official OpenAI SDK (sync, async, streaming) through the gateway to simulated vLLM pods."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest

from tests.conftest import models_of

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
async def gateway_url(start_mock_pod, start_gateway):
    pods = [await start_mock_pod(), await start_mock_pod()]
    gw = await start_gateway([p.url for p in pods])
    return gw.url, pods


async def test_sync_client_chat_content_usage_and_id_unchanged(gateway_url, tokenizer):
    url, pods = gateway_url

    def call() -> openai.types.chat.ChatCompletion:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="mock-llama", messages=MESSAGES, max_tokens=6, extra_headers={"x-request-id": "req-sync-1"}
        )
        assert raw.headers["x-request-id"] == "req-sync-1"
        assert raw.headers["x-gateway-pod"] in {f"127.0.0.1:{p.port}" for p in pods}
        return raw.parse()

    completion = await asyncio.to_thread(call)
    # The pod builds its id from the request id the gateway forwarded.
    assert completion.id == "chatcmpl-req-sync-1"
    assert completion.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert completion.usage.completion_tokens == 6
    assert completion.choices[0].message.content == " The quick brown fox"[: len(completion.choices[0].message.content)]
    assert completion.choices[0].finish_reason == "length"


async def test_async_client_streaming_chat_with_usage(gateway_url):
    url, _ = gateway_url
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="mock-llama", messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    non_stream = await client.chat.completions.create(model="mock-llama", messages=MESSAGES, max_tokens=5)
    assert non_stream.choices[0].message.content == text
    await client.close()


async def test_async_client_completions_embeddings_models(gateway_url, tokenizer):
    url, _ = gateway_url
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    completion = await client.completions.create(model="mock-llama", prompt="Once upon a time", max_tokens=3)
    assert completion.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    assert completion.choices[0].text
    stream = await client.completions.create(model="mock-llama", prompt="Once upon", max_tokens=3, stream=True)
    assert len([c async for c in stream]) == 3
    embeddings = await client.embeddings.create(model="mock-llama", input=["a", "b c"])
    assert [d.index for d in embeddings.data] == [0, 1] and len(embeddings.data[0].embedding) == 16
    models = await client.models.list()
    assert [m.id for m in models.data] == ["mock-llama"]
    await client.close()


async def test_unknown_model_is_an_openai_not_found(gateway_url):
    url, _ = gateway_url
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"
    await client.close()


async def test_responses_endpoint_is_routed_like_chat(start_backend, start_gateway, http):
    from aiohttp import web

    seen = []

    async def responses(request):
        seen.append(await request.json())
        return web.json_response({"id": "resp-1", "object": "response", "output": []})

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models_of("m"))
    gw = await start_gateway([await start_backend(app)])
    async with http.post(f"{gw.url}/v1/responses", json={"model": "m", "input": "hi"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["id"] == "resp-1"
    # The body as sent, and the response id the gateway chose (a client never chooses the stored id).
    [body] = seen
    assert re.fullmatch(r"resp_[0-9a-f]{32}", body.pop("request_id")) and body == {"model": "m", "input": "hi"}
