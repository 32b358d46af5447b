"""The clients people run, unchanged: the official ``openai`` and ``anthropic`` SDKs against a gateway with API
keys on, each sending its key its own way (Bearer; ``x-api-key``, or Bearer with an auth token), streaming,
and every error parsed by the SDK's own error classes; what a refused request is recorded as."""

from __future__ import annotations

import anthropic
import openai
import pytest

from gateway.config import hash_api_key
from tests.integration.test_verification import metric

MODEL = "mock-llama"
KEYS = {"keys": [{"hash": hash_api_key("sk-all"), "name": "all"},
                 {"hash": hash_api_key("sk-other"), "name": "other", "models": ["other-model"]}]}
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
async def gw(start_mock_pod, start_gateway):
    pods = [await start_mock_pod(), await start_mock_pod(model="other-model")]
    return await start_gateway([p.url for p in pods], auth=KEYS)


def openai_client(gw, key: str = "sk-all") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


async def test_the_openai_sdk_with_its_bearer_key(gw):
    client = openai_client(gw)
    answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert answer.usage.completion_tokens == 3
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == \
        answer.choices[0].message.content
    response = await client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3)
    assert response.output_text == answer.choices[0].message.content
    # A key limited to one model lists only that one.
    assert [m.id async for m in client.models.list()] == [MODEL, "other-model"]
    assert [m.id async for m in openai_client(gw, "sk-other").models.list()] == ["other-model"]
    await client.close()


async def test_the_openai_sdks_errors_parse_into_its_own_classes(gw):
    client = openai_client(gw)
    with pytest.raises(openai.AuthenticationError) as refused:
        await openai_client(gw, "sk-wrong").chat.completions.create(model=MODEL, messages=MESSAGES)
    assert refused.value.code == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as forbidden:
        await openai_client(gw, "sk-other").chat.completions.create(model=MODEL, messages=MESSAGES)
    assert forbidden.value.param == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    # What vLLM answers as `'int' object is not iterable` in its own shape, the gateway refuses naming the field.
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 123}])
    assert bad.value.param == "messages.0.content" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_headers={"x-priority": "9" * 23})
    assert bad.value.param == "x-priority"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.create(model=MODEL, input=[{"role": "wizard", "content": "hi"}])
    assert bad.value.param == "input.0.role"
    with pytest.raises(openai.NotFoundError) as gone:
        await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")
    assert gone.value.param == "previous_response_id"
    await client.close()


async def test_the_anthropic_sdk_with_its_x_api_key_and_with_an_auth_token(gw):
    by_key = anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-all", max_retries=0)
    by_token = anthropic.AsyncAnthropic(base_url=gw.url, auth_token="sk-all", max_retries=0)  # Bearer
    for client in (by_key, by_token):
        message = await client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
        assert message.usage.output_tokens == 4
        async with client.messages.stream(model=MODEL, max_tokens=4, messages=MESSAGES) as stream:
            assert (await stream.get_final_message()).content[0].text == message.content[0].text
        counted = await client.messages.count_tokens(model=MODEL, messages=MESSAGES)
        assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) + (
            message.usage.cache_creation_input_tokens or 0)


async def test_the_anthropic_sdks_errors_parse_into_its_own_classes(gw):
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-all", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=MESSAGES)
    with pytest.raises(anthropic.PermissionDeniedError):
        await anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-other", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": 5}])
    assert bad.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "messages.0.content: must be a string or a list "
                                                                    "of content blocks."}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, extra_body={"temperature": 1.5})
    assert bad.value.body["error"]["message"].startswith("temperature:")


async def test_admin_pages_take_the_admin_key_either_way(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], auth={**KEYS, "admin_key_hashes": [hash_api_key("sk-admin")]})
    for headers in ({"authorization": "Bearer sk-admin"}, {"x-api-key": "sk-admin"}):
        async with http.get(f"{gw.url}/debug/pods", headers=headers) as resp:
            assert resp.status == 200
    for headers in ({}, {"x-api-key": "sk-all"}):
        async with http.get(f"{gw.url}/metrics", headers=headers) as resp:
            assert resp.status == 401


async def test_every_status_is_recorded_as_itself(start_mock_pod, start_gateway, http):
    """A refused key (401), a body past the limit (413, counted as 500 before) and one that arrives too slowly
    (408) are counted under their own status, as the client got it."""
    pod = await start_mock_pod()
    gw = await start_gateway([pod.url], auth=KEYS, server={"max_body_bytes": 4096, "body_timeout_s": 0.3})
    key = {"authorization": "Bearer sk-all"}
    async with http.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                         headers={"x-api-key": "sk-wrong"}) as resp:
        assert resp.status == 401
    async with http.post(f"{gw.url}/v1/chat/completions", headers=key,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}) as resp:
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"

    async def trickle():
        yield b'{"model": "mock-llama", '
        await __import__("asyncio").sleep(1.0)
        yield b'"messages": []}'

    async with http.post(f"{gw.url}/v1/chat/completions", data=trickle(), headers=key) as resp:
        assert resp.status == 408
    text = await (await http.get(f"{gw.url}/metrics")).text()
    for status in ("401", "413", "408"):
        assert metric(text, "gateway_requests_total", status=status) == 1, status
    assert metric(text, "gateway_requests_total", status="500") == 0
