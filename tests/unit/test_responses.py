"""The Responses API's parts, one at a time: its input rendered as vLLM renders it (checked against vLLM on a
request Codex sent), the bounded store, the tap that finds a stream's last event, the usage it reports,
and the validation and error translation every route shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ResponsesConfig, TokenizationConfig
from gateway.core.errors import GatewayError
from gateway.core.inference_api import InferenceRequest, parse_inference_request
from gateway.core.usage import usage_of_body, usage_of_stream_tail
from gateway.proxy.pod_errors import translated
from gateway.request.responses_state import _EventCapture
from gateway.request.validation import check_body, check_headers
from gateway.responses.store import MemoryResponses, ResponsesMetrics, StoredResponse, decode, encode
from gateway.tokenization import openai_responses as responses
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from gateway.tokenization.local import LocalTokenizer

CODEX = json.loads((Path(__file__).parents[1] / "fixtures" / "codex_responses_request.json").read_text())


def test_codex_input_items_and_tools_render_as_vllm_renders_them():
    """vLLM 0.32's own construct_input_messages and construct_tool_dicts, run on a request Codex sent (a
    namespace of tools, a web search tool, developer messages, a tool call, its output, reasoning)."""
    body = CODEX["body"]
    assert responses.chat_messages(body.get("instructions"), body["input"]) == CODEX["vllm_messages"]
    assert responses.chat_tools(body["tools"]) == CODEX["vllm_tools"]
    assert responses.chat_tools([{"type": "custom", "name": "apply_patch", "description": "patch"}]) == [
        {"type": "function", "function": {"name": "apply_patch", "description": "patch", "parameters": {
            "type": "object", "properties": {"input": {"type": "string",
                                                       "description": "The freeform text payload for this tool."}},
            "required": ["input"], "additionalProperties": False}}}]


async def test_a_responses_prompt_starts_with_the_special_tokens_and_its_next_turn_reuses_it():
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR)
    local = LocalTokenizer(tokenizer, TokenizationConfig())
    first = InferenceRequest(instructions="Be brief.", input=[{"role": "user", "content": "A question " * 30}])
    messages = responses.chat_messages(first.instructions, first.input)
    tokens = await local.chat(messages, first, None, tokenizer.special_prefix)
    assert tokenizer.special_prefix == (0,)
    assert list(tokens.ids) == tokenizer.encode_chat(messages, add_special_tokens=True)
    local.remember(tokens, None)  # type: ignore[arg-type]
    grown = [*messages, {"role": "assistant", "content": "An answer."}, {"role": "user", "content": "More?"}]
    again = await local.chat(grown, first, None, tokenizer.special_prefix)
    assert again.earlier is not None  # the earlier turn's ids were reused
    assert list(again.ids) == tokenizer.encode_chat(grown, add_special_tokens=True)
    chat = await local.chat(grown, first, None)  # the same conversation as chat reuses nothing of it
    assert chat.earlier is None and list(chat.ids) == list(again.ids)[1:]


def stored(response_id: str, created: float = 100.0, size: int = 10) -> StoredResponse:
    return StoredResponse(response_id, "pod", "", response_id, created, b"[" + b" " * size + b"]", b"{}")


def test_the_memory_store_is_bounded_by_count_bytes_and_age():
    now = [100.0]
    store = MemoryResponses(ResponsesConfig(max_responses=3, max_bytes=400, ttl_s=60), ResponsesMetrics(
        CollectorRegistry()), clock=lambda: now[0])
    for name in "abcd":
        store.keep(stored(name))
    assert store.find("a") is None and [store.find(n) is not None for n in "bcd"] == [True] * 3  # by count
    store.keep(stored("big", size=300))  # by bytes: the least recently used go first
    assert store.find("b") is None and store.find("big") is not None and store.bytes <= 400
    now[0] = 161.0
    assert store.find("big") is None and len(store) < 3  # by age
    assert decode(encode(stored("x"))) == stored("x")


def test_a_response_larger_than_the_byte_bound_is_not_kept_and_evicts_none_of_the_others():
    registry = CollectorRegistry()
    store = MemoryResponses(ResponsesConfig(max_responses=10, max_bytes=400), ResponsesMetrics(registry),
                            clock=lambda: 100.0)
    for name in "abc":
        store.keep(stored(name))
    kept = store.bytes
    store.keep(stored("huge", size=1000))
    assert store.find("huge") is None and [store.find(n) is not None for n in "abc"] == [True] * 3
    assert store.bytes == kept and registry.get_sample_value("gateway_responses_total", {"event": "evicted"}) == 1


def test_the_tap_finds_a_streams_event_across_chunks():
    event = b'event: response.completed\ndata: {"response": {"id": "resp_1"}}\n\n'
    stream = b'event: response.created\ndata: {"response": {"id": "resp_1"}}\n\n' + event
    for cut in range(1, len(stream)):
        capture = _EventCapture("response.completed")
        found = [capture.feed(stream[:cut]), capture.feed(stream[cut:])]
        assert [f for f in found if f is not None] == [b'{"response": {"id": "resp_1"}}'], cut
        assert capture.done


def test_the_responses_usage_is_read_whole_and_from_a_streams_last_event():
    usage = {"input_tokens": 329, "input_tokens_details": {"cached_tokens": 256, "cache_write_tokens": 0},
             "output_tokens": 8, "total_tokens": 337}
    whole = usage_of_body(json.dumps({"id": "resp_1", "usage": usage}).encode())
    assert (whole.prompt_tokens, whole.cached_tokens, whole.completion_tokens) == (329, 256, 8)
    last = b"event: response.completed\ndata: " + json.dumps({"response": {"usage": usage}}).encode() + b"\n\n"
    tail = usage_of_stream_tail([b"event: response.output_text.delta\ndata: {}\n\n", last])
    assert (tail.prompt_tokens, tail.cached_tokens) == (329, 256)
    anthropic = usage_of_body(b'{"usage": {"input_tokens": 3, "cache_read_input_tokens": 5, "output_tokens": 1}}')
    assert (anthropic.prompt_tokens, anthropic.cached_tokens) == (8, 5)


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("chat", {}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 123}]}, "messages.0.content"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("chat", {"messages": [{"role": "user", "content": [5]}]}, "messages.0.content.0"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, None),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
    ("completions", {"prompt": [[1, 2], "x"]}, "prompt"),
    ("completions", {"prompt": [1, -2]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [3]]}, None),
    ("embeddings", {"input": []}, "input"),
    ("responses", {}, "input"),
    ("responses", {"input": 5}, "input"),
    ("responses", {"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ("responses", {"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ("responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input.0.arguments"),
    ("responses", {"input": [{"type": "web_search_call", "id": "ws"}]}, None),  # the pod judges what it knows
    ("responses", {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}]},
     None),
])
def test_a_body_its_api_does_not_allow_is_refused_naming_the_field(kind, body, param):
    request = parse_inference_request(json.dumps({"model": "m", **body}).encode())
    if param is None:
        check_body(kind, request)
        return
    with pytest.raises(GatewayError) as refused:
        check_body(kind, request)
    assert refused.value.param in (param, param.split(".")[0]) and refused.value.message.startswith(param)


@pytest.mark.parametrize(("name", "value", "valid"), [
    ("x-priority", "99999999999999999999999", False), ("x-priority", "1001", False), ("x-priority", "-7", True),
    ("x-priority", "high", False), ("x-workflow-complete", "maybe", False), ("x-workflow-complete", "TRUE", True),
    ("x-stage-cache-policy", "keep", False), ("x-stage-preserve-threshold", "-1", False),
    ("x-slo-ttft-ms", "0", False), ("x-slo-ttft-ms", "nan", False), ("x-slo-e2e-ms", "250.5", True),
    ("x-gateway-inference-fairness-id", " ", False), ("x-session-id", "s" * 257, False),
    ("x-claude-code-session-id", "0b7c6a3e-2f6d-4c1e-9d8e-0a1b2c3d4e5f", True), ("x-request-id", "", True),
])
def test_a_gateway_header_it_cannot_mean_is_refused_naming_it(name, value, valid):
    if valid:
        check_headers({name: value})
        return
    with pytest.raises(GatewayError) as refused:
        check_headers({name: value})
    assert refused.value.param == name and refused.value.message.startswith(name)


@pytest.mark.parametrize(("status", "body", "expected"), [
    (400, b'{"error": {"message": "\'int\' object is not iterable", "type": "BadRequestError", "param": null, '
          b'"code": 400}}', (400, "'int' object is not iterable", "invalid_request_error", None, None)),
    (404, b'{"error": {"message": "Response with id \'r\' not found.", "type": "invalid_request_error", '
          b'"param": "response_id", "code": 404}}',
     (404, "Response with id 'r' not found.", "invalid_request_error", None, "response_id")),
    (429, b'{"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}',
     (429, "slow down", "rate_limit_error", None, None)),
    (404, b'{"detail": "Not Found"}', (501, "The pods serving this model do not implement /v1/responses (they "
                                            "answered 404).", "invalid_request_error", "unsupported_endpoint", None)),
    (405, b"405: Method Not Allowed", (501, "The pods serving this model do not implement /v1/responses (they "
                                            "answered 405).", "invalid_request_error", "unsupported_endpoint", None)),
    (409, b"busy", (409, "busy", "invalid_request_error", None, None)),
    (422, b'{"detail": "bad field"}', (422, "bad field", "invalid_request_error", None, None)),
])
def test_a_pods_error_keeps_its_status_and_text_in_the_routes_shape(status, body, expected):
    error = translated(status, body, "/v1/responses?x=1")
    assert (error.status, error.message, error.type, error.code, error.param) == expected
    assert json.loads(error.body(anthropic=True)) == {"type": "error", "error": {
        "type": {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            error.status, "api_error" if error.status >= 500 else "invalid_request_error"), "message": error.message}}
