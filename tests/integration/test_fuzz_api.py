"""Fuzzing the HTTP API of a real gateway process (kv_aware, admission and workflows on) in front of a
simulated pod: whatever the body, its encoding and the headers, on any API, never a 5xx (the gateway's or a
pod's) and never a traceback; every error is in the route's own shape (OpenAI's standard types and string
codes, or Anthropic's on /v1/messages), never the pod's; a refused JSON body names the field or header at
fault. The four generating routes (chat, completions, responses, messages) get well over 500 bodies."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import zlib

import brotli
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import gateway_process

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False,
                         allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=4)), max_leaves=12)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                           "content": st.one_of(st.text(max_size=40), json_values)}),
    json_values), max_size=4)
# Mostly the real model, so most cases get past validation into tokenization, routing and the pod.
models = st.one_of(st.just("mock-llama"), st.just("mock-llama"), st.just("mock-llama"), st.text(max_size=8),
                   json_scalars)
bodies = st.fixed_dictionaries({"model": models}, optional={
    "messages": st.one_of(messages, json_values),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 2**33), min_size=1, max_size=6),
                        st.lists(st.lists(st.integers(-5, 9), max_size=3), max_size=2), json_values),
    "max_tokens": st.one_of(st.integers(-3, 8), json_scalars),
    "n": st.one_of(st.integers(-2, 200), json_scalars),
    "temperature": st.one_of(st.floats(-1, 3), json_scalars),
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
    st.fixed_dictionaries({"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result", "image", "x"])},
                          optional={"text": st.one_of(st.text(max_size=20), json_values),
                                    "thinking": json_values, "input": json_values, "name": json_values,
                                    "id": json_values, "tool_use_id": json_values, "content": json_values}),
    json_values), max_size=3)
anthropic_messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", ""]),
                           "content": st.one_of(st.text(max_size=40), blocks, json_values)}),
    json_values), max_size=4)
anthropic_bodies = st.fixed_dictionaries({"model": models}, optional={
    "messages": st.one_of(anthropic_messages, json_values),
    "max_tokens": st.one_of(st.integers(-3, 8), json_scalars),
    "system": st.one_of(st.text(max_size=20), blocks, json_values),
    "thinking": json_values, "tools": json_values, "tool_choice": json_values, "metadata": json_values,
    "stream": st.one_of(st.booleans(), json_scalars), "output_config": json_values,
})
# Responses input items: messages, tool calls and their outputs, reasoning, and anything else.
items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", ""]),
                           "content": st.one_of(st.text(max_size=30), blocks, json_values)},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning",
                                                    "custom_tool_call", "web_search_call", "x"])},
                          optional={"call_id": json_values, "name": json_values, "arguments": json_values,
                                    "output": json_values, "summary": json_values, "content": json_values}),
    json_values), max_size=4)
responses_bodies = st.fixed_dictionaries({"model": models}, optional={
    "input": st.one_of(st.text(max_size=40), items, json_values),
    "instructions": st.one_of(st.text(max_size=20), json_values),
    "previous_response_id": st.one_of(st.text(max_size=12), json_scalars),
    "store": st.one_of(st.booleans(), json_scalars), "background": st.one_of(st.booleans(), json_scalars),
    "max_output_tokens": st.one_of(st.integers(-3, 8), json_scalars), "stream": st.one_of(st.booleans(), json_scalars),
    "tools": json_values, "tool_choice": json_values, "temperature": st.one_of(st.floats(-1, 3), json_scalars),
    "top_p": st.one_of(st.floats(-1, 2), json_scalars), "reasoning": json_values, "include": json_values,
})
OPENAI_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "rate_limit_error",
                "server_error", "service_unavailable", "upstream_error"}
ENCODERS = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress, "identity": lambda b: b}


@pytest.fixture(scope="module")
def gateway_url():
    with gateway_process("--mock-pods", "1", "--mock-speed", "0", "--policy", "kv_aware",
                         env={"GATEWAY_ADMISSION__ENABLED": "true"}, capture_stderr=True) as run:
        yield run.url, run.proc
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
          names_field: bool = False) -> None:
    """No 5xx (the gateway's or a pod's), and an error in the route's shape, whoever decided it; with
    ``names_field`` (a JSON body was sent), a refusal names the field or header at fault (on the Anthropic
    routes, the gateway's own: a pod's message is relayed as the pod wrote it, and vLLM's name none)."""
    assert status < 500, payload[:500]
    assert b"Traceback" not in payload
    if status < 400:
        return
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
    url, proc = gateway_url
    check(*post(url, path, json.dumps(body).encode(), hdrs), names_field=True)
    assert proc.poll() is None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(body=responses_bodies, hdrs=headers, continued=st.booleans())
@example(body={"model": "mock-llama", "input": [{"type": "function_call_output", "output": 5}]}, hdrs={},
         continued=True)
@example(body={"model": "mock-llama", "input": "Hi", "background": True}, hdrs={}, continued=False)  # refused: a 400
def test_responses_bodies_and_headers(gateway_url, body, hdrs, continued):
    """The Responses API: input items of every kind, stored or not, continuing a stored response or an
    unknown one."""
    url, proc = gateway_url
    if continued and isinstance(body.get("previous_response_id"), str):
        body = {**body, "previous_response_id": stored_response(url)}
    check(*post(url, "/v1/responses", json.dumps(body).encode(), hdrs), "/v1/responses", names_field=True)
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
    url, proc = gateway_url
    check(*post(url, path, json.dumps(body).encode(), {**hdrs, "anthropic-version": "2023-06-01"}), path,
          names_field=True)
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
    url, _ = gateway_url
    check(*post(url, path, raw, {}), path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=st.one_of(paths, anthropic_paths), body=st.one_of(bodies.map(json.dumps).map(str.encode),
                                                              st.binary(max_size=100)),
       encoding=st.sampled_from([*ENCODERS, "zstd", "x-gzip", "compress", "gzip, br"]), encode=st.booleans(),
       cut=st.integers(0, 30))
def test_encoded_bodies(gateway_url, path, body, encoding, encode, cut):
    """Bodies in every content-encoding, well and badly encoded, whole and cut short."""
    url, _ = gateway_url
    data = ENCODERS[encoding](body) if encode and encoding in ENCODERS else body
    if cut and encode:
        data = data[: max(1, len(data) - cut)]
    check(*post(url, path, data, {"content-encoding": encoding}), path)


def test_schemathesis_against_the_gateways_own_openapi(gateway_url):
    """Schemathesis generates requests from /openapi.json: no 5xx from the gateway, ever."""
    url, proc = gateway_url
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "st"), "run", f"{url}/openapi.json", "--checks",
         "not_a_server_error", "--max-examples", "40", "--seed", "1", "--workers", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert proc.poll() is None
