"""Fuzzing the HTTP API of a real gateway process (kv_aware, admission and workflows on) in front of a
simulated pod: whatever the body and headers, never a 500 and never a traceback; errors are OpenAI-shaped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
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
    "stream": st.one_of(st.booleans(), json_scalars),
    "stream_options": json_values,
    "tools": json_values,
    "chat_template_kwargs": json_values,
    "metadata": json_values,
    "user": json_values,
    "input": json_values,
})
header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
headers = st.dictionaries(st.sampled_from([
    "x-workflow-id", "x-stage-id", "x-stage-cache-policy", "x-stage-preserve-threshold", "x-workflow-complete",
    "x-session-id", "x-routing-strategy", "x-slo-ttft-ms", "x-slo-e2e-ms", "x-priority", "x-request-id",
    "authorization"]), header_values, max_size=5)
paths = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"])


@pytest.fixture(scope="module")
def gateway_url():
    with gateway_process("--mock-pods", "1", "--mock-speed", "0", "--policy", "kv_aware",
                         env={"GATEWAY_ADMISSION__ENABLED": "true"}, capture_stderr=True) as run:
        yield run.url, run.proc
    assert b"Traceback" not in run.stderr and b"internal error" not in run.stderr, run.stderr.decode()[-3000:]


def post(url: str, path: str, body: bytes, hdrs: dict[str, str]) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={"content-type": "application/json", **hdrs})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read(), resp.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("content-type", "")


def check(status: int, payload: bytes, ctype: str) -> None:
    assert status != 500, payload[:500]
    assert b"Traceback" not in payload
    if status >= 400:
        assert ctype.startswith("application/json"), (status, payload[:200])
        error = json.loads(payload)["error"]
        assert error["message"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=paths, body=bodies, hdrs=headers)
def test_structured_bodies_and_headers(gateway_url, path, body, hdrs):
    url, proc = gateway_url
    check(*post(url, path, json.dumps(body).encode(), hdrs))
    assert proc.poll() is None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=paths, raw=st.binary(max_size=200))
def test_raw_bytes(gateway_url, path, raw):
    url, _ = gateway_url
    check(*post(url, path, raw, {}))


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
