"""Fuzzing the HTTP API of a real gateway process (kv_aware, admission and workflows on) in front of a
simulated pod: whatever the body, its encoding, its content type and the headers, on any API, never a 5xx
(the gateway's or a pod's) and never a traceback; every error is in the route's own shape (OpenAI's standard
types and string codes, or Anthropic's on /v1/messages), never the pod's; a refused JSON body names the field
or header at fault; and no body reaches the pod to be refused there for what the gateway could have judged
(a field's type or bound, a part's or item's type, the answer's length against the model's context): a pod's
refusal is only for what the gateway cannot know (:data:`POD_ONLY`). The four generating routes (chat,
completions, responses, messages) get well over 500 bodies; each module run prints its tally."""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import zlib

import brotli
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.request.validation import RESPONSES_ITEM_TYPES
from tests.conftest import gateway_process

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False,
                         allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=4)), max_leaves=12)
# Roles: mostly real ones, also of any JSON type (an object or a list is not even hashable).
roles = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", ""]),
                  st.sampled_from(["user", "assistant"]), st.sampled_from([{}, {"a": 1}, ["user"], 123, None]),
                  json_values)
# Content parts: the API's types, vLLM's, and others.
parts = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_text", "refusal", "bogus", "x"])},
                          optional={"text": st.one_of(st.text(max_size=20), json_values)}),
    json_values), min_size=1, max_size=3)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": roles, "content": st.one_of(st.text(max_size=40), parts, json_values)}),
    json_values), max_size=4)
# Token counts: small ones, and ones no model's context holds, of every JSON number shape.
token_counts = st.one_of(st.integers(-3, 8), json_scalars,
                         st.sampled_from([10**30, 1e30, 3.5, 8.0, 2**63, 131_072, 131_071, 1 << 20]))
# Mostly the real model, so most cases get past validation into tokenization, routing and the pod.
models = st.one_of(st.just("mock-llama"), st.just("mock-llama"), st.just("mock-llama"), st.text(max_size=8),
                   json_scalars)
bodies = st.fixed_dictionaries({"model": models}, optional={
    "messages": st.one_of(messages, json_values),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 2**33), min_size=1, max_size=6),
                        st.lists(st.lists(st.integers(-5, 9), max_size=3), max_size=2), json_values),
    "max_tokens": token_counts,
    "max_completion_tokens": token_counts,
    "n": st.one_of(st.integers(-2, 200), json_scalars),
    "temperature": st.one_of(st.floats(-1, 3), json_scalars),
    "presence_penalty": st.one_of(st.floats(-3, 3), json_scalars),
    "seed": st.one_of(st.integers(-(2**64), 2**64), json_scalars),
    "stream": st.one_of(st.booleans(), json_scalars),
    "stream_options": json_values,
    "tools": json_values,
    "chat_template_kwargs": json_values,
    "metadata": json_values,
    "user": json_values,
    "input": json_values,
})
header_values = st.one_of(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
                          st.integers(-(10**25), 10**25).map(str), st.sampled_from(["true", "false", "maybe", ""]),
                          st.text(alphabet="ab", min_size=300, max_size=600))
headers = st.dictionaries(st.sampled_from([
    "x-workflow-id", "x-stage-id", "x-stage-cache-policy", "x-stage-preserve-threshold", "x-workflow-complete",
    "x-session-id", "x-routing-strategy", "x-slo-ttft-ms", "x-slo-e2e-ms", "x-priority", "x-request-id",
    "x-gateway-inference-fairness-id", "x-gateway-inference-objective", "x-claude-code-session-id",
    "x-claude-code-agent-id", "session-id", "authorization", "x-api-key"]), header_values, max_size=5)
paths = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"])
anthropic_paths = st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"])
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic content: mostly well-formed blocks, each field also of any JSON type.
blocks = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result", "image", "x",
                                                    "bogus", "input_text"])},
                          optional={"text": st.one_of(st.text(max_size=20), json_values),
                                    "thinking": json_values, "input": json_values, "name": json_values,
                                    "id": json_values, "tool_use_id": json_values, "content": json_values}),
    json_values), max_size=3)
anthropic_messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", ""]), roles),
                           "content": st.one_of(st.text(max_size=40), blocks, json_values)}),
    json_values), max_size=4)
anthropic_bodies = st.fixed_dictionaries({"model": models}, optional={
    "messages": st.one_of(anthropic_messages, json_values),
    "max_tokens": token_counts,
    "system": st.one_of(st.text(max_size=20), blocks, json_values),
    "thinking": json_values, "tools": json_values, "tool_choice": json_values, "metadata": json_values,
    "stream": st.one_of(st.booleans(), json_scalars), "output_config": json_values,
})
# Responses input items: messages, tool calls and their outputs, reasoning, and anything else.
items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer", "tool", ""]),
                                             roles),
                           "content": st.one_of(st.text(max_size=30), blocks, parts, json_values)},
                          optional={"type": st.sampled_from(["message", "message", "bogus"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning",
                                                    "custom_tool_call", "web_search_call", "x", "bogus"])},
                          optional={"call_id": json_values, "name": json_values, "arguments": json_values,
                                    "output": json_values, "summary": json_values, "content": json_values}),
    json_values), max_size=4)
responses_bodies = st.fixed_dictionaries({"model": models}, optional={
    "input": st.one_of(st.text(max_size=40), items, json_values),
    "instructions": st.one_of(st.text(max_size=20), json_values),
    "previous_response_id": st.one_of(st.text(max_size=12), json_scalars),
    "store": st.one_of(st.booleans(), json_scalars), "background": st.one_of(st.booleans(), json_scalars),
    "max_output_tokens": token_counts, "stream": st.one_of(st.booleans(), json_scalars),
    "tools": json_values, "tool_choice": json_values, "temperature": st.one_of(st.floats(-1, 3), json_scalars),
    "top_p": st.one_of(st.floats(-1, 2), json_scalars), "reasoning": json_values, "include": json_values,
})
# What a pod may refuse that the gateway cannot judge: its KV cache's size, what the simulated pod does not
# render (images, documents: a real multimodal one does), and what the Responses API allows but vLLM 0.32
# does not render (an item of another type, encrypted reasoning, a namespaced call: a newer engine may).
POD_ONLY = ("The request needs more KV-cache blocks than this engine has.", "the simulated pod cannot render",
            "Unsupported input: encrypted reasoning", "Unsupported input: a namespaced tool call")
UNRENDERED_ITEM = re.compile(r"Unsupported input: input item of type '(\w+)'")
OPENAI_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "rate_limit_error",
                "server_error", "service_unavailable", "upstream_error"}
ENCODERS = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress, "identity": lambda b: b}


@pytest.fixture(scope="module")
def tally():
    """What the module's requests got: answers by status class and by who decided them, and the messages
    of the pods' refusals (printed at the end: ``pytest -s``)."""
    counts: collections.Counter[str] = collections.Counter()
    yield counts
    print("\nfuzz tally:", dict(sorted(counts.items())))


@pytest.fixture(scope="module")
def gateway_url(tally):
    with gateway_process("--mock-pods", "1", "--mock-speed", "0", "--policy", "kv_aware",
                         env={"GATEWAY_ADMISSION__ENABLED": "true"}, capture_stderr=True) as run:
        yield run.url, run.proc, tally
    assert b"Traceback" not in run.stderr and b"internal error" not in run.stderr, run.stderr.decode()[-3000:]


def post(url: str, path: str, body: bytes, hdrs: dict[str, str]) -> tuple[int, bytes, str, bool]:
    """Status, body and content type of the answer, and whether a pod answered it (not the gateway)."""
    request = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={"content-type": "application/json", **hdrs})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read(), resp.headers.get("content-type", ""), "x-gateway-pod" in resp.headers
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("content-type", ""), "x-gateway-pod" in err.headers


def check(status: int, payload: bytes, ctype: str, from_pod: bool, path: str = "/v1/chat/completions",
          names_field: bool = False, tally: collections.Counter[str] | None = None) -> None:
    """No 5xx (the gateway's or a pod's), and an error in the route's shape, whoever decided it; with
    ``names_field`` (a JSON body was sent), a refusal names the field or header at fault (on the Anthropic
    routes, the gateway's own: a pod's message is relayed as the pod wrote it, and vLLM's name none); a
    pod's refusal only for what the gateway cannot judge."""
    if tally is not None:
        tally["requests"] += 1
        tally[f"{status // 100}xx {'pod' if from_pod else 'gateway'}"] += 1
    assert status < 500, payload[:500]
    assert b"Traceback" not in payload
    if status < 400:
        return
    if from_pod:
        message = json.loads(payload)["error"]["message"]
        if tally is not None:
            tally[f"pod refused: {message[:60]}"] += 1
        unrendered = UNRENDERED_ITEM.match(message)
        assert message.startswith(POD_ONLY) or (unrendered and unrendered[1] in RESPONSES_ITEM_TYPES), payload[:300]
    assert ctype.startswith("application/json"), (status, payload[:200])
    body = json.loads(payload)
    if path in ANTHROPIC_PATHS:
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        field = body["error"]["message"].partition(":")[0]
    else:
        error = body["error"]
        assert set(body) == {"error"} and set(error) == {"message", "type", "code", "param"}, body
        assert error["message"] and error["type"] in OPENAI_TYPES, body  # not a pod's "BadRequestError"
        assert error["code"] is None or isinstance(error["code"], str), body  # not a pod's integer code
        field = error["param"]
    if names_field and status in (400, 404, 422) and not (from_pod and path in ANTHROPIC_PATHS):
        assert field and " " not in field, body


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=paths, body=bodies, hdrs=headers)
def test_structured_bodies_and_headers(gateway_url, path, body, hdrs):
    url, proc, tally = gateway_url
    check(*post(url, path, json.dumps(body).encode(), hdrs), path, names_field=True, tally=tally)
    assert proc.poll() is None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(body=responses_bodies, hdrs=headers, continued=st.booleans())
@example(body={"model": "mock-llama", "input": [{"type": "function_call_output", "output": 5}]}, hdrs={},
         continued=True)
@example(body={"model": "mock-llama", "input": "Hi", "background": True}, hdrs={}, continued=False)  # refused: a 400
@example(body={"model": "mock-llama", "input": []}, hdrs={}, continued=False)  # no conversation: a 400
def test_responses_bodies_and_headers(gateway_url, body, hdrs, continued):
    """The Responses API: input items of every kind, stored or not, continuing a stored response or an
    unknown one."""
    url, proc, tally = gateway_url
    if continued and isinstance(body.get("previous_response_id"), str):
        body = {**body, "previous_response_id": stored_response(url)}
    check(*post(url, "/v1/responses", json.dumps(body).encode(), hdrs), "/v1/responses", names_field=True,
          tally=tally)
    assert proc.poll() is None


def stored_response(url: str) -> str:
    status, payload, _, _ = post(url, "/v1/responses", json.dumps({"model": "mock-llama", "input": "Hi",
                                                                   "max_output_tokens": 2}).encode(), {})
    assert status == 200, payload
    return json.loads(payload)["id"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=anthropic_paths, body=anthropic_bodies, hdrs=headers)
@example(path="/v1/messages", hdrs={}, body={"model": "mock-llama", "max_tokens": 4, "system": 5,
                                              "messages": [{"role": "user", "content": "hi"}]})
@example(path="/v1/messages", hdrs={}, body={"model": "mock-llama", "max_tokens": -3,
                                              "messages": [{"role": "user", "content": 5}]})
@example(path="/v1/messages/count_tokens", hdrs={}, body={"model": "mock-llama", "thinking": "on",
                                                           "messages": [{"role": "user", "content": [5]}]})
@example(path="/v1/messages", hdrs={}, body={"model": "mock-llama", "max_tokens": 4,  # more than the pod holds
                                              "messages": [{"role": "user", "content": "many words " * 40_000}]})
def test_anthropic_bodies_and_headers(gateway_url, path, body, hdrs):
    url, proc, tally = gateway_url
    check(*post(url, path, json.dumps(body).encode(), {**hdrs, "anthropic-version": "2023-06-01"}), path,
          names_field=True, tally=tally)
    assert proc.poll() is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=st.one_of(paths, anthropic_paths), raw=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda head, junk: head + junk, st.sampled_from([b'{"model": "mock-llama", "messages": "', b"{"]),
              st.binary(min_size=1, max_size=40)),  # invalid UTF-8 inside a string, among the rest
    st.integers(500, 20_000).map(lambda depth: b'{"model": "mock-llama", "prompt": ' + b"[" * depth + b"]" * depth
                                 + b"}"),
))
def test_raw_bytes(gateway_url, path, raw):
    url, _, tally = gateway_url
    check(*post(url, path, raw, {}), path, tally=tally)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=st.one_of(paths, anthropic_paths), body=st.one_of(bodies.map(json.dumps).map(str.encode),
                                                              st.binary(max_size=100)),
       encoding=st.sampled_from([*ENCODERS, "zstd", "x-gzip", "compress", "gzip, br"]), encode=st.booleans(),
       cut=st.integers(0, 30))
def test_encoded_bodies(gateway_url, path, body, encoding, encode, cut):
    """Bodies in every content-encoding, well and badly encoded, whole and cut short."""
    url, _, tally = gateway_url
    data = ENCODERS[encoding](body) if encode and encoding in ENCODERS else body
    if cut and encode:
        data = data[: max(1, len(data) - cut)]
    check(*post(url, path, data, {"content-encoding": encoding}), path, tally=tally)


# One valid body per generating route, and where each of its fields the gateway judges lives in it.
VALID = {
    "/v1/chat/completions": {"model": "mock-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": "mock-llama", "max_tokens": 2, "prompt": "Hi"},
    "/v1/responses": {"model": "mock-llama", "max_output_tokens": 2, "input": [{"role": "user", "content": "Hi"}]},
    "/v1/messages": {"model": "mock-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
}
CONVERSATION = {"/v1/chat/completions": "messages", "/v1/responses": "input", "/v1/messages": "messages"}
TOKEN_FIELDS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"), "/v1/completions": ("max_tokens",),
                "/v1/responses": ("max_output_tokens",), "/v1/messages": ("max_tokens",)}
numbers = st.one_of(json_scalars, st.sampled_from([10**30, 1e30, -1e30, 3.5, 8.0, 0, -1, 2**63, 2**64, 131_072,
                                                   131_071, 131_070, 1 << 20]))
part_types = st.sampled_from(["text", "input_text", "output_text", "image_url", "refusal", "thinking", "tool_use",
                              "document", "bogus", "x", "", "TEXT"])
item_types = st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "web_search_call",
                              "item_reference", "bogus", "x", ""])


@st.composite
def one_fault(draw) -> tuple[str, dict, str]:
    """A valid body with one field replaced, and the field's path (as a 400 names it)."""
    path = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[path]))
    conversation = CONVERSATION.get(path)
    sites = ["tokens", "number"] + (["role", "part"] if conversation else []) + (["item"] if path == "/v1/responses"
                                                                             else [])
    site = draw(st.sampled_from(sites))
    if site == "tokens":
        field = draw(st.sampled_from(TOKEN_FIELDS[path]))
        body[field] = draw(numbers)
    elif site == "number":
        field = draw(st.sampled_from(["temperature", "top_p", "n", "presence_penalty", "seed"]))
        body[field] = draw(numbers)
    elif site == "role":
        field = f"{conversation}.0.role"
        body[conversation][0]["role"] = draw(st.one_of(st.sampled_from([{}, {"a": 1}, ["user"], 123, None, "robot"]),
                                                       json_values))
    elif site == "part":
        field = f"{conversation}.0.content.0"  # its type, or a field that type requires
        body[conversation][0]["content"] = [{"type": draw(part_types), "text": "Hi"}]
    else:
        field = "input.0.type"
        body["input"] = [{"type": draw(item_types), "role": "user", "content": "Hi", "call_id": "c", "name": "f",
                          "arguments": "{}", "output": "ok", "summary": [], "id": "x"}]
    return path, body, field


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=one_fault())
@example(case=("/v1/chat/completions", {**VALID["/v1/chat/completions"], "messages": [{"role": {}}]},
               "messages.0.role"))
@example(case=("/v1/chat/completions", {**VALID["/v1/chat/completions"],
                                        "messages": [{"role": ["user"], "content": "Hi"}]}, "messages.0.role"))
@example(case=("/v1/chat/completions", {**VALID["/v1/chat/completions"], "max_tokens": 10**30}, "max_tokens"))
@example(case=("/v1/messages", {**VALID["/v1/messages"], "max_tokens": 10**30}, "max_tokens"))
@example(case=("/v1/messages", {**VALID["/v1/messages"],
                                "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
               "messages.0.content.0.type"))
@example(case=("/v1/responses", {**VALID["/v1/responses"], "input": [{"type": "bogus"}]}, "input.0.type"))
def test_one_bad_field(gateway_url, case):
    """A valid body but for one field: the gateway refuses it naming that field, or the pod serves it
    (never refuses it: see :data:`POD_ONLY`); on the Anthropic route the message starts with the field."""
    url, proc, tally = gateway_url
    path, body, field = case
    status, payload, ctype, from_pod = post(url, path, json.dumps(body).encode(), {"anthropic-version": "2023-06-01"})
    check(status, payload, ctype, from_pod, path, names_field=True, tally=tally)
    if status >= 400 and not from_pod:
        error = json.loads(payload)["error"]
        named = error["message"].partition(":")[0] if path in ANTHROPIC_PATHS else error["param"]
        assert named == field or named.startswith(f"{field}."), (field, payload[:300])
        tally[f"refused one bad {re.sub(r'[.][0-9]+', '', field)}"] += 1
    assert proc.poll() is None


JSON_TYPES = ("application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json",
              "application/octet-stream", "")
NOT_JSON_TYPES = ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/xml", "text/json", "image/png", "json")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=st.one_of(paths, anthropic_paths),
       content_type=st.one_of(st.sampled_from(JSON_TYPES + NOT_JSON_TYPES),
                              st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)),
       prompt=st.text(min_size=1, max_size=20))
@example(path="/v1/chat/completions", content_type="text/plain", prompt="Hi")
def test_content_types(gateway_url, path, content_type, prompt):
    """A body whose type says it is not JSON is refused, naming the header, before any pod sees it; a JSON
    type, or none declared, is served (and sent on as application/json: the pod counts no refusal)."""
    url, _, tally = gateway_url
    body = {"model": "mock-llama", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}],
            "prompt": prompt, "input": prompt}
    status, payload, ctype, from_pod = post(url, path, json.dumps(body).encode(),
                                            {"content-type": content_type, "anthropic-version": "2023-06-01"})
    check(status, payload, ctype, from_pod, path, names_field=True, tally=tally)
    media = content_type.partition(";")[0].strip().lower()
    if media in ("application/json", "application/octet-stream", "") or (
            media.startswith("application/") and media.endswith("+json")):
        assert status == 200, payload[:300]
    else:
        assert status == 400 and not from_pod, payload[:300]
        assert b"content-type" in payload, payload[:300]


def test_schemathesis_against_the_gateways_own_openapi(gateway_url):
    """Schemathesis generates requests from /openapi.json: no 5xx from the gateway, ever."""
    url, proc, _ = gateway_url
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "st"), "run", f"{url}/openapi.json", "--checks",
         "not_a_server_error", "--max-examples", "40", "--seed", "1", "--workers", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert proc.poll() is None
