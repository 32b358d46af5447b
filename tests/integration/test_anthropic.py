"""The Anthropic Messages API through the gateway, with the official ``anthropic`` SDK against simulated
vLLM pods: routed precisely (the prompt tokenized exactly as the engine renders it), streamed byte for
byte, errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import time

import anthropic
import pytest

from gateway.core.inference_api import InferenceRequest
from gateway.tokenization import anthropic as conversion
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from tests.integration.test_kv_routing import MODEL, fleet, synced, system_prompt
from tests.integration.test_verification import metric


def client(gw) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0)


async def test_messages_are_routed_by_their_cached_prefix_and_predictions_check_out(start_mock_pod, start_gateway,
                                                                                     http):
    pods, gw = await fleet(start_mock_pod, start_gateway, n=3)
    sdk = client(gw)
    chosen = []
    for i in range(6):
        raw = await sdk.messages.with_raw_response.create(
            model=MODEL, max_tokens=4, system=system_prompt(1),
            messages=[{"role": "user", "content": [{"type": "text", "text": f"Question {i}?"}]}])
        message = await raw.parse()
        assert message.type == "message" and message.content[0].type == "text" and message.content[0].text
        predicted = int(raw.headers["x-gateway-prefix-tokens"])
        assert predicted == (message.usage.cache_read_input_tokens or 0)  # the engine found what was predicted
        chosen.append((raw.headers["x-gateway-pod"], predicted))
        await synced(gw, pods)
    assert len({pod for pod, _ in chosen[1:]}) == 1 and all(p > 0 for _, p in chosen[1:])  # its prefix's pod
    text = await (await http.get(f"{gw.url}/metrics")).text()
    assert metric(text, "gateway_routing_decisions_total", policy="kv_aware", reason="cache_hit") >= 5
    assert metric(text, "gateway_kv_prediction_exact_total", outcome="exact") == 6
    assert metric(text, "gateway_tokenization_total", model=MODEL, mode="local", outcome="ok") == 6


async def test_a_stream_is_relayed_event_by_event(start_mock_pod, start_gateway):
    _, gw = await fleet(start_mock_pod, start_gateway, n=2)
    async with client(gw).messages.stream(model=MODEL, max_tokens=5, system="Be brief.",
                                          messages=[{"role": "user", "content": "Stream please."}]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.usage.output_tokens == 5 and final.content[0].text


async def test_errors_come_in_anthropics_shape(start_mock_pod, start_gateway, http):
    _, gw = await fleet(start_mock_pod, start_gateway, n=1)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client(gw).messages.create(model="no-such-model", max_tokens=4,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    async with http.post(f"{gw.url}/v1/messages", data=b"{not json") as resp:
        body = await resp.json()
    assert resp.status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    async with http.post(f"{gw.url}/v1/chat/completions", data=b"{not json") as resp:
        assert "type" not in await resp.json()  # the OpenAI routes keep OpenAI's shape


def test_conversion_matches_vllms_for_tools_results_and_inline_system():
    req = InferenceRequest(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc=1;"}, {"type": "text", "text": "Sys."}],
        messages=[
            {"role": "user", "content": "Find it."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                              {"type": "tool_use", "id": "t1", "name": "grep", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
            {"role": "system", "content": "Reminder."},
        ],
        tools=[{"name": "grep", "description": "search", "input_schema": {"type": "object"}}])
    assert conversion.chat_messages(req, merge_inline_system=False) == [
        {"role": "system", "content": "Sys."},  # the billing header, which changes per request, is dropped
        {"role": "user", "content": "Find it."},
        {"role": "assistant", "reasoning": "hmm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "grep", "arguments": '{"q": "x"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
        {"role": "system", "content": "Reminder."},
    ]
    assert conversion.chat_messages(req, merge_inline_system=True)[0] == {"role": "system",
                                                                          "content": "Sys.Reminder."}
    assert conversion.chat_tools(req) == [{"type": "function", "function": {
        "name": "grep", "description": "search", "parameters": {"type": "object"}}}]
    with pytest.raises(conversion.NotRenderable):
        conversion.chat_messages(InferenceRequest(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]), False)
    assert HfTokenizer(BUNDLED_TOKENIZER_DIR).system_first is False  # the mock template takes inline system


async def test_count_tokens_is_answered_by_a_pod_and_touches_no_workflow(start_mock_pod, start_gateway, tokenizer):
    _, gw = await fleet(start_mock_pod, start_gateway, n=2)
    messages = [{"role": "user", "content": "How long is this?"}]
    counted = await client(gw).messages.count_tokens(model=MODEL, system="Be brief.", messages=messages,
                                                     extra_headers={"x-workflow-id": "wf-count"})
    expected = tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *messages])
    assert counted.input_tokens == len(expected)
    assert "wf-count" not in gw.kits.workflows.service.tracker.workflows  # counting is not a stage
    with pytest.raises(anthropic.NotFoundError):
        await client(gw).messages.count_tokens(model="nope", messages=messages)


async def test_a_declared_cache_ttl_keeps_the_session_resumable_and_a_bad_one_is_refused(start_mock_pod,
                                                                                         start_gateway, http):
    """Claude Code marks its prefix with cache_control on every turn: the session's context stays resumable
    for the TTL it declares, long past its think window (1 s here); the body reaches the engine as sent."""
    _, gw = await fleet(start_mock_pod, start_gateway, n=2, placement={"default_think_s": 0.5, "max_protect_s": 1.0})
    sdk = client(gw)
    session = {"X-Claude-Code-Session-Id": "cc-1"}
    system = [{"type": "text", "text": system_prompt(1), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    raw = await sdk.messages.with_raw_response.create(
        model=MODEL, max_tokens=4, system=system, messages=[{"role": "user", "content": "Plan it."}],
        extra_headers=session)
    assert (await raw.parse()).content[0].text
    await sdk.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Plan it."}],
                              extra_headers={"X-Claude-Code-Session-Id": "cc-2"})  # declares nothing
    working_set = gw.kits.kv.working_set
    declared, undeclared = working_set.context("session:cc-1"), working_set.context("session:cc-2")
    assert declared.retention_s == 3600.0 and declared.pod == raw.headers["x-gateway-pod"]
    assert undeclared is not None and undeclared.retention_s is None
    await asyncio.sleep(1.5)  # past the think window of both
    working_set.lapse(time.monotonic())
    assert working_set.context("session:cc-1") is declared and working_set.context("session:cc-2") is None
    bad = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]}
    async with http.post(f"{gw.url}/v1/messages", json=bad) as resp:
        body = await resp.json()
    assert resp.status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].cache_control.ttl must be '5m' or '1h'" in body["error"]["message"]
