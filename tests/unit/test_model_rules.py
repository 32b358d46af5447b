"""Public model names: aliases, sticky weighted splits, fallbacks, and the model rewritten both ways."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from multidict import CIMultiDict

from gateway.config import ModelRule, ModelsConfig, ModelTarget, load_config
from gateway.core.facts import SplitPinned
from gateway.core.inference_api import parse_inference_request
from gateway.models.rules import ModelRules
from gateway.proxy.rewrite import AnswerRewrite, with_model
from gateway.workflow.context import ContextSignals

CANARY = {"rules": {
    "chat": {"targets": [{"model": "stable", "weight": 90}, {"model": "canary", "weight": 10}],
             "fallbacks": ["small"]},
    "mini": {"target": "llama", "fallbacks": ["small", "tiny"], "expose_target": True},
}}


def rules(config=CANARY, publish=None, draw=None) -> ModelRules:
    kwargs = {"publish": publish} if publish else {}
    if draw:
        kwargs["draw"] = draw
    return ModelRules(load_config(overrides={"models": config}, environ={}).models, ContextSignals(), **kwargs)


def route(r: ModelRules, body: dict, headers: dict | None = None, kind: str = "chat"):
    parsed = parse_inference_request(json.dumps(body).encode())
    return r.route(parsed.model, kind, CIMultiDict(headers or {}), parsed)


def chat(model: str = "chat", content: str = "hi", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def test_an_alias_names_its_target_then_its_fallbacks():
    r = route(rules(), chat("mini"))
    assert r.targets == ("llama", "small", "tiny") and r.expose_target and not r.split
    assert r.fallback_after("small") and not r.fallback_after("tiny")
    plain = route(rules(), chat("llama"))
    assert plain.targets == ("llama",) and plain.public == "llama"


def test_a_split_holds_its_weights_over_ten_thousand_sessions_and_no_session_moves():
    r = rules()
    first = {s: route(r, chat(), {"x-session-id": f"s{s}"}).targets for s in range(10_000)}
    shares = Counter(targets[0] for targets in first.values())
    assert abs(shares["stable"] / 10_000 - 0.9) <= 0.02 and abs(shares["canary"] / 10_000 - 0.1) <= 0.02
    assert all(targets[1:] == ("small",) for targets in first.values())
    # Later turns, and a reload that moves the weights: every session keeps the target it began with.
    halves = [ModelTarget("stable", 50), ModelTarget("canary", 50)]
    r.reconfigure(ModelsConfig(rules={"chat": ModelRule(targets=halves)}))
    assert all(route(r, chat(content="next turn"), {"x-session-id": f"s{s}"}).targets[0] == first[s][0]
               for s in range(10_000))
    fresh = Counter(route(r, chat(), {"x-session-id": f"new{s}"}).targets[0] for s in range(2_000))
    assert 0.45 < fresh["canary"] / 2_000 < 0.55  # new sessions get the new weights


def test_the_same_session_gets_the_same_target_in_every_process():
    pins: list[SplitPinned] = []
    one, other = rules(publish=pins.append), rules()
    targets = {s: route(one, chat(), {"x-session-id": f"s{s}"}).targets[0] for s in range(500)}
    assert {s: route(other, chat(), {"x-session-id": f"s{s}"}).targets[0] for s in range(500)} == targets
    assert len(pins) == 500 and {p.key for p in pins} == {f"session:s{s}" for s in range(500)}
    # A process that got the pins keeps them through a reload it made alone.
    third = rules({"rules": {"chat": {"targets": [{"model": "stable", "weight": 1}, {"model": "canary",
                                                                                   "weight": 99}]}}})
    for pin in pins:
        third.apply_remote("elsewhere", pin)
    assert all(route(third, chat(), {"x-session-id": f"s{s}"}).targets[0] == targets[s] for s in range(500))


def test_sticky_keys_workflow_conversation_response_and_a_chats_opening():
    r = rules()
    seen = {route(r, chat(), {"x-workflow-id": "wf"}).sticky,
            route(r, chat(conversation="c1"), kind="responses").sticky,
            route(r, chat(conversation={"id": "c2"}), kind="responses").sticky}
    assert seen == {"workflow:wf", "session:c1", "session:c2"}  # a Responses conversation is a session
    # An anonymous chat is known by its opening: every turn re-sends it.
    opening = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "First question"}]
    turn1 = route(r, {"model": "chat", "messages": opening})
    turn2 = route(r, {"model": "chat", "messages": [*opening, {"role": "assistant", "content": "A"},
                                                    {"role": "user", "content": "Second"}]})
    assert turn1.sticky == turn2.sticky and turn1.targets == turn2.targets
    # A Responses answer pins the response that continues it to the target that answered, from the first
    # (drawn by the weights: it has no key) on.
    canary_draws = rules(draw=lambda: 0.99)
    for n in range(20):
        first = route(canary_draws, {"model": "chat", "input": f"hello {n}"}, kind="responses")
        assert first.split and first.sticky is None and first.targets[0] == "canary"
        canary_draws.answered(first, "canary", f"resp_{n}")
        later = route(canary_draws, {"model": "chat", "input": "more", "previous_response_id": f"resp_{n}"},
                      kind="responses")
        assert later.sticky == f"response:resp_{n}" and later.targets[0] == "canary"
    assert not route(r, chat("mini")).split


def test_requests_without_a_key_are_drawn_by_the_weights():
    draws = iter([0.0, 0.5, 0.89, 0.9, 0.99])
    r = rules(draw=lambda: next(draws))
    assert [route(r, {"model": "chat", "input": "x"}, kind="responses").targets[0] for _ in range(5)] == \
        ["stable", "stable", "stable", "canary", "canary"]


@pytest.mark.parametrize("bad, message", [
    ({"rules": {"a": {}}}, "either target"),
    ({"rules": {"a": {"target": "x", "targets": [{"model": "y"}]}}}, "either target"),
    ({"rules": {"a": {"target": "x", "fallbacks": ["x"]}}}, "once"),
    ({"rules": {"a": {"targets": [{"model": "x", "weight": 0}]}}}, "positive weight"),
    ({"rules": {"a": {"target": "b"}, "b": {"target": "c"}}}, "public name itself"),
    ({"rules": {"a": {"target": "b"}}, "adapters": {"a": {"path": "/p", "base_model": "m"}}}, "adapter"),
])
def test_bad_rules_are_refused_naming_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides={"models": bad}, environ={})


def test_the_request_names_the_target_and_nothing_else_changes():
    body = b'{"model": "chat", "messages": [{"role": "user", "content": "say \\"model\\": \\"chat\\""}], "n": 1}'
    assert with_model(body, "chat", "stable") == body.replace(b'"model": "chat"', b'"model": "stable"', 1)
    # A nested model key: decoded and encoded again, only the top-level one changed.
    nested = b'{"model":"chat","tools":[{"model":"chat"}],"big":123456789012345678901234567890}'
    assert json.loads(with_model(nested, "chat", 'odd"name')) == {**json.loads(nested), "model": 'odd"name'}
    later = b'{"tools": [{"model": "chat"}], "model": "chat", "big": 123456789012345678901234567890}'
    assert json.loads(with_model(later, "chat", "stable")) == {**json.loads(later), "model": "stable"}


def test_the_answer_names_the_public_model_in_every_event_even_cut_in_two():
    rewrite = AnswerRewrite("stable", "chat", capture_response_id=True)
    quoted = b'"\\"model\\":\\"stable\\""'  # a string that looks like the member: left alone
    events = [b'data: {"id":"resp_1","model":"stable","choices":[{"delta":{"content":' + quoted + b'}}]}\n\n',
              b'data: {"model": "stable", "choices": []}\n\n', b"data: [DONE]\n\n"]
    stream = b"".join(events)
    out = [rewrite.chunk(stream[i:i + 7]) for i in range(0, len(stream), 7)] + [rewrite.rest()]
    assert b"".join(out) == stream.replace(b'"model":"stable"', b'"model":"chat"', 1).replace(
        b'"model": "stable"', b'"model": "chat"')
    assert rewrite.response_id == "resp_1"
    assert AnswerRewrite("stable", "chat").body(b'{"model":"stable","x":1}') == b'{"model":"chat","x":1}'


def test_a_session_that_uses_two_split_names_keeps_its_target_of_each_through_a_reload():
    """An agent asks for a main model and a small one in one session (Claude Code: sonnet and haiku)."""
    two = {"rules": {"chat": CANARY["rules"]["chat"],
                     "fast": {"targets": [{"model": "fast-a", "weight": 1}, {"model": "fast-b", "weight": 1}]}}}
    r = rules(two)
    sessions = [{"x-session-id": f"s{s}"} for s in range(200)]
    first = [route(r, chat(), headers).targets[0] for headers in sessions]
    for headers in sessions:
        route(r, chat("fast"), headers)
    assert first.count("stable") > 100
    r.reconfigure(ModelsConfig(rules={"chat": ModelRule(targets=[ModelTarget("stable", 1),
                                                                 ModelTarget("canary", 10**6)]),
                                      "fast": ModelRule(targets=[ModelTarget("fast-a"), ModelTarget("fast-b")])}))
    assert [route(r, chat(content="next turn"), headers).targets[0] for headers in sessions] == first
