"""What the gateway refuses before any pod sees it, one rule at a time: roles of any JSON type, the types of
content parts, Anthropic blocks and Responses items (every type the official SDKs send is accepted), the
answer's length against the model's context, and the body's content type."""

from __future__ import annotations

import json
import re
import typing

import pytest
from anthropic.types import ContentBlockParam
from anthropic.types.beta import BetaContentBlockParam
from anthropic.types.beta.beta_tool_result_block_param import Content as BetaToolResultContent
from openai.types.chat import ChatCompletionContentPartParam
from openai.types.chat.chat_completion_assistant_message_param import ContentArrayOfContentPart
from openai.types.responses import ResponseInputContentParam, ResponseInputItemParam
from openai.types.responses.response_output_message_param import Content as ResponseOutputContent

from gateway.core.errors import GatewayError
from gateway.core.inference_api import RequestKind, parse_inference_request
from gateway.request.validation import (
    CHAT_PART_TYPES,
    RESPONSES_ITEM_TYPES,
    RESPONSES_PART_TYPES,
    check_body,
    check_content_type,
    check_output_tokens,
)
from gateway.tokenization.anthropic import BLOCK_TYPES, TOOL_RESULT_TYPES

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("kind", "body", "param"), [
    # A role that is an object or a list was the gateway's 500 (an unhashable set lookup).
    ("chat", {"messages": [{"role": {}, "content": "hi"}]}, "messages.0.role"),
    ("chat", {"messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages.0.role"),
    ("chat", {"messages": [{"role": ["user"], "content": "hi"}]}, "messages.0.role"),
    ("responses", {"input": [{"role": {"a": 1}, "content": "hi"}]}, "input.0.role"),
    ("responses", {"input": [{"type": "message", "role": ["user"], "content": "hi"}]}, "input.0.role"),
    ("responses", {"input": [{"role": None, "content": "hi"}]}, "input.0.role"),
    ("messages", {"max_tokens": 5, "messages": [{"role": ["user"], "content": "hi"}]}, "messages.0.role"),
    # Types outside the API's.
    ("chat", {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages.0.content.0.type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, None),
    ("chat", {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]}, None),
    ("responses", {"input": [{"type": "bogus"}]}, "input.0.type"),
    ("responses", {"input": [{"type": 5}]}, "input.0.type"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]},
     "input.0.content.0.type"),
    ("responses", {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]}, None),
    ("responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}, None),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
     "messages.0.content.0.type"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_use"}]}]}]},
     "messages.0.content.0.content.0.type"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, None),
    # What Anthropic's API requires and vLLM would drop into an empty conversation.
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages.0.content.0.text"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "thinking"}]}]},
     "messages.0.content.0.thinking"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ("messages", {"max_tokens": 5, "messages": [*HI, {"role": "assistant", "content": ""}, *HI]},
     "messages.1.content"),
    ("messages", {"max_tokens": 5, "messages": [*HI, {"role": "assistant", "content": []}]}, None),
    # Responses: a conversation to render; instructions a string.
    ("responses", {"input": []}, "input"),
    ("responses", {"input": [], "instructions": "Be brief."}, None),
    ("responses", {"input": "hi", "instructions": ["x"]}, "instructions"),
    # Numbers.
    ("chat", {"messages": HI, "presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"messages": HI, "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("completions", {"prompt": "hi", "seed": -(2**63)}, None),
])
def test_a_body_its_api_does_not_allow_is_refused_naming_the_field(kind, body, param):
    request = parse_inference_request(json.dumps({"model": "m", **body}).encode())
    if param is None:
        check_body(RequestKind(kind), request)
        return
    with pytest.raises(GatewayError) as refused:
        check_body(RequestKind(kind), request)
    assert refused.value.param in (param, param.split(".")[0]) and refused.value.message.startswith(param + ":")


def test_a_refused_type_lists_the_accepted_ones():
    request = parse_inference_request(json.dumps({"model": "m", "input": [{"type": "bogus"}]}).encode())
    with pytest.raises(GatewayError) as refused:
        check_body(RequestKind.RESPONSES, request)
    assert refused.value.code == "invalid_request" and "function_call_output" in refused.value.message


@pytest.mark.parametrize(("body", "number"), [
    ({"max_tokens": 10**30}, True), ({"max_tokens": "8"}, True), ({"max_tokens": 8.0}, True),
    ({"max_tokens": 3.5}, True), ({"max_tokens": 0}, True), ({"n": 1e3}, True), ({"max_tokens": 8}, False),
])
def test_token_counts_are_integers_of_at_least_one(body, number):
    """An integer field takes no number with a fraction part (8.0 included, as OpenAI's API) and no
    string; a count below one is refused by the parser, a huge one against the context (below)."""
    raw = json.dumps({"model": "m", "messages": HI, **body}).encode()
    if not number or body.get("max_tokens") == 10**30:
        parse_inference_request(raw)
        return
    with pytest.raises(GatewayError) as refused:
        parse_inference_request(raw)
    assert refused.value.param == next(iter(body))


@pytest.mark.parametrize(("kind", "body", "prompt", "param"), [
    (RequestKind.CHAT, {"max_tokens": 10**30}, None, "max_tokens"),
    (RequestKind.CHAT, {"max_tokens": 1000}, None, "max_tokens"),  # no room for a prompt of one token
    (RequestKind.CHAT, {"max_tokens": 999}, None, None),
    (RequestKind.CHAT, {"max_tokens": 990}, 10, None),  # exactly the context, as vLLM allows
    (RequestKind.CHAT, {"max_tokens": 991}, 10, "max_tokens"),
    (RequestKind.CHAT, {"max_tokens": 10**30, "max_completion_tokens": 5}, 10, None),  # vLLM reads the latter
    (RequestKind.CHAT, {"max_completion_tokens": 5000}, 10, "max_completion_tokens"),
    (RequestKind.COMPLETIONS, {"max_tokens": 995}, 10, "max_tokens"),
    (RequestKind.MESSAGES, {"max_tokens": 2**40}, None, "max_tokens"),
    (RequestKind.RESPONSES, {"max_output_tokens": 1000, "max_tokens": 1}, None, "max_output_tokens"),
    (RequestKind.EMBEDDINGS, {"max_tokens": 10**30}, None, None),
])
def test_an_answer_longer_than_the_context_leaves_is_refused_naming_its_field(kind, body, prompt, param):
    request = parse_inference_request(json.dumps({"model": "m", **body}).encode())
    if param is None:
        check_output_tokens(kind, request, 1000, prompt)
        check_output_tokens(kind, request, None, prompt)  # a context no pod lists: the pod judges
        return
    with pytest.raises(GatewayError) as refused:
        check_output_tokens(kind, request, 1000, prompt)
    error = refused.value
    assert error.param == param and error.message.startswith(param + ":") and error.code == "context_length_exceeded"
    assert "1000 tokens" in error.message


@pytest.mark.parametrize(("value", "valid"), [
    ("application/json", True), ("application/json; charset=utf-8", True), ("Application/JSON", True),
    ("application/vnd.api+json", True), ("application/octet-stream", True), (None, True), ("", True),
    ("text/plain", False), ("text/plain; charset=utf-8", False), ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False), ("text/json", False), ("application/xml", False),
])
def test_a_body_declared_not_json_is_refused_naming_the_header(value, valid):
    headers = {} if value is None else {"content-type": value}
    if valid:
        check_content_type(headers)
        return
    with pytest.raises(GatewayError) as refused:
        check_content_type(headers)
    assert refused.value.param == "content-type" and refused.value.code == "unsupported_media_type"
    assert ("curl -d" in refused.value.message) == (value == "application/x-www-form-urlencoded")


def _types(union: object) -> set[str]:
    """The ``type`` literals of a union of the SDKs' TypedDicts (read from their annotations' text: some
    name types only imported under TYPE_CHECKING)."""
    if typing.get_origin(union) is typing.Annotated:
        return _types(typing.get_args(union)[0])
    if typing.get_origin(union) is typing.Union:
        return set().union(*map(_types, typing.get_args(union)))
    annotations: dict[str, object] = {}
    for cls in reversed(getattr(union, "__mro__", ())):
        annotations.update(getattr(cls, "__annotations__", {}))
    return set(re.findall(r"['\"](\w+)['\"]", str(annotations["type"]).partition("Literal[")[2]))


@pytest.mark.parametrize(("sent", "accepted"), [
    (_types(ChatCompletionContentPartParam) | _types(ContentArrayOfContentPart), CHAT_PART_TYPES),
    (_types(ResponseInputContentParam) | _types(ResponseOutputContent), RESPONSES_PART_TYPES),
    (_types(ResponseInputItemParam), RESPONSES_ITEM_TYPES),
    (_types(ContentBlockParam) | _types(BetaContentBlockParam), BLOCK_TYPES),
    (_types(BetaToolResultContent), TOOL_RESULT_TYPES),
])
def test_every_type_the_official_sdks_send_is_accepted(sent, accepted):
    """The type lists are the APIs' as the installed SDKs define them: an SDK that adds a type fails here
    until the gateway accepts it."""
    assert len(sent) >= 2 and sent <= accepted, sorted(sent - accepted)


@pytest.mark.parametrize("prompt", [[1, 4096], [[5], [7, 5000]]])
def test_a_token_id_past_the_vocabulary_is_refused_naming_the_prompt(prompt):
    from gateway.request.validation import check_token_ids_in_vocabulary

    with pytest.raises(GatewayError, match="out of the model's vocabulary") as refused:
        check_token_ids_in_vocabulary(prompt, 4096)
    assert refused.value.param == "prompt"
    for fine in ([0, 4095], [[1], [4095]], "text", ["a", "b"]):
        check_token_ids_in_vocabulary(fine, 4096)
