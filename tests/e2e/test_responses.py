"""The Responses API on real vLLM pods: a conversation continued by ``previous_response_id`` through the
gateway's store finds its earlier turns cached on the pod, as the same conversation sent as chat with its
history does; and the simulated pod answers the Responses API in the wire format real vLLM does."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from simulator.pod import MockPod, MockPodConfig
from tests.e2e.conftest import MODEL, VllmFleet
from tests.e2e.test_real_vllm import document, post, step_engine

QUESTIONS = [document(f"responses-q{i}", 150) for i in range(3)]
INSTRUCTIONS = document("responses-instructions", 300)
EXTRA = {"ignore_eos": True}  # random weights may pick EOS at once


@pytest.fixture
async def kv_gateway(start_gateway, vllm: VllmFleet, model_dir: str, http: aiohttp.ClientSession):
    """A gateway routing by ``kv_aware`` with the model's tokenizer, in front of both pods, their caches empty."""
    for pod in vllm.pods:
        await post(http, f"{pod.url}/reset_prefix_cache", {})
        await step_engine(http, pod.url)
    return await start_gateway(vllm.gateway_pods(), routing={"policy": "kv_aware"},
                               health={"interval_s": 0.3, "timeout_s": 2.0, "failure_threshold": 2},
                               tokenization={"models": {MODEL: {"path": model_dir}}})


async def test_a_conversations_later_turns_find_the_earlier_ones_cached(kv_gateway) -> None:
    """Three turns of ``previous_response_id`` (the pods keep nothing: the gateway sends each turn's whole
    conversation), then the same conversation as chat with its history: turns 2 and 3 are cached as much
    as the chat's are, and the gateway predicted each turn's cached tokens exactly."""
    gw = kv_gateway
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    responses: list[tuple[str, int, int, int]] = []  # pod, predicted, cached, input tokens
    previous, answers = None, []
    for question in QUESTIONS:
        raw = await client.responses.with_raw_response.create(
            model=MODEL, instructions=INSTRUCTIONS, input=question, max_output_tokens=8, extra_body=EXTRA,
            previous_response_id=previous.id if previous else None)
        previous = raw.parse()
        usage = previous.usage
        responses.append((raw.headers["x-gateway-pod"], int(raw.headers["x-gateway-prefix-tokens"]),
                          usage.input_tokens_details.cached_tokens, usage.input_tokens))
        answers.append(previous.output_text)
    assert (await client.responses.retrieve(previous.id)).id == previous.id
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    chats: list[tuple[str, int, int]] = []  # pod, cached, prompt tokens
    for question, answer in zip(QUESTIONS, answers, strict=True):
        messages.append({"role": "user", "content": question})
        raw_chat = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, extra_body=EXTRA)
        usage = raw_chat.parse().usage
        chats.append((raw_chat.headers["x-gateway-pod"], usage.prompt_tokens_details.cached_tokens,
                      usage.prompt_tokens))
        messages.append({"role": "assistant", "content": answer})
    await client.close()
    assert len({pod for pod, *_ in responses}) == 1, responses  # the conversation stayed with its cache
    assert all(predicted == cached for _, predicted, cached, _ in responses), responses
    response_ratio = sum(c for _, _, c, _ in responses[1:]) / sum(n for *_, n in responses[1:])
    chat_ratio = sum(c for _, c, _ in chats[1:]) / sum(n for *_, n in chats[1:])
    assert all(cached > 0 for _, _, cached, _ in responses[1:]), responses
    assert response_ratio >= chat_ratio - 0.02, (response_ratio, chat_ratio, responses, chats)


def _shape(value: Any) -> Any:
    """The keys of a JSON value, all the way down (lists by their first element), without the values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


async def _answers(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """What a pod answers to the Responses API, reduced to its shape: a whole response, a stream's event
    types (each run of deltas as one) and its last event, an unknown id continued and retrieved."""
    body = {"model": MODEL, "input": "Say something.", "instructions": "Be brief.", "max_output_tokens": 4,
            **EXTRA}
    whole, headers = await post(http, f"{url}/v1/responses", body)
    async with http.post(f"{url}/v1/responses", json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/event-stream")
        text = await resp.text()
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    kinds = [lines[0].removeprefix("event: ") for lines in events]
    runs = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    last = json.loads(events[-1][1].removeprefix("data: "))
    async with http.post(f"{url}/v1/responses", json={**body, "previous_response_id": "resp_none"}) as resp:
        unknown = (resp.status, _shape(await resp.json()))
    async with http.get(f"{url}/v1/responses/resp_none") as resp:
        missing = (resp.status, _shape(await resp.json()))
    return {"content_type": headers["content-type"], "whole": _shape(whole), "events": runs,
            "completed": _shape(last), "unknown": unknown, "missing": missing}


async def test_the_simulator_answers_the_responses_api_as_vllm_does(vllm: VllmFleet, http, model_dir) -> None:
    mock = MockPod(MockPodConfig(model=MODEL, tokenizer=model_dir, events_port=None, speed=0.0, block_size=128))
    await mock.start()
    try:
        real, simulated = await _answers(http, vllm[0].url), await _answers(http, mock.url)
    finally:
        await mock.stop()
    assert simulated == real
