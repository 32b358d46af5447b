"""Declared retention: what clients say they will reuse (Anthropic cache_control, OpenAI
prompt_cache_retention), and what the working set does with it."""

from __future__ import annotations

import msgspec
import pytest

from gateway.config import PlacementConfig
from gateway.core.errors import ErrorKind, GatewayError
from gateway.core.inference_api import parse_inference_request
from gateway.core.retention import declared_retention_s
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from tests.unit.test_working_set import BS, ws


def retention(body: dict) -> float | None:
    return declared_retention_s(parse_inference_request(msgspec.json.encode({"model": "m", **body})))


def test_anthropic_breakpoints_declare_their_ttl_and_the_longest_wins():
    ephemeral = {"type": "ephemeral"}
    assert retention({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert retention({"system": [{"type": "text", "text": "s", "cache_control": ephemeral}]}) == 300.0
    assert retention({"tools": [{"name": "t", "input_schema": {}, "cache_control": {**ephemeral, "ttl": "1h"}}],
                      "messages": [{"role": "user", "content": [
                          {"type": "text", "text": "a", "cache_control": {**ephemeral, "ttl": "5m"}}]}]}) == 3600.0
    assert retention({"system": "a plain string system prompt", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": None}]}]}) is None


def test_openai_prompt_cache_retention():
    assert retention({"prompt_cache_retention": "in_memory"}) == 300.0
    assert retention({"prompt_cache_retention": "24h", "prompt_cache_key": "k"}) == 86_400.0


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"ttl": "2h"}}]}]},
     "messages[0].content[0].cache_control"),
    ({"system": [{"type": "text", "text": "s", "cache_control": "ephemeral"}]}, "system[0].cache_control"),
])
def test_a_retention_the_apis_do_not_define_is_a_clear_400(body, param):
    with pytest.raises(GatewayError) as raised:
        retention(body)
    assert raised.value.kind is ErrorKind.INVALID_REQUEST and raised.value.param == param


def test_a_declared_retention_keeps_a_context_resumable_past_its_think_window():
    s = ws()  # think 1 s x margin 2: resumable for 2 s after each request
    declared = s.hold("workflow:a", "p0", BS, [1, 2, 3], 48, now=0.0)
    declared.retention_s = 300.0  # as ContextPlacement passes it to hold()
    undeclared = s.hold("workflow:b", "p0", BS, [4, 5], 32, now=0.0)
    s.idle(declared, now=10.0)
    s.idle(undeclared, now=10.0)
    assert declared.retained(now=309.0) and not undeclared.retained(now=11.0)
    assert s.demand_tokens("p0", now=12.5) == 3 * BS  # b lapsed with its think window; a is still counted
    assert s.context("workflow:b") is None and s.context("workflow:a") is declared
    assert s.demand_tokens("p0", now=310.5) == 0 and s.context("workflow:a") is None


def test_the_retention_is_the_latest_requests_and_replicates_with_it():
    published = []  # what the other workers and replicas are told
    s = ResumableWorkingSet(PlacementConfig(), InFlightLedger(), publish=published.append)
    ctx = s.hold("workflow:a", True, "p0", BS, [1, 2], 32, 0.0, retention_s=3600.0)
    assert ctx.retention_s == 3600.0 and ctx.retained(now=10_000.0)  # running: in use whatever the TTL
    s.hold("workflow:a", True, "p0", BS, [1, 2, 3], 48, 1.0)
    assert ctx.retention_s is None and published[-1].retention_s is None
    s.hold("workflow:a", True, "p0", BS, [1, 2, 3, 4], 64, 2.0, retention_s=300.0)
    assert published[-1].retention_s == 300.0
    replica = ResumableWorkingSet(PlacementConfig(), InFlightLedger())
    replica.apply_remote("other", published[-1])
    assert replica.context("workflow:a").retention_s == 300.0
