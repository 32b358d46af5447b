"""Every branch of the workflow cache policy chain, the pressure modes, sessions and header parsing."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config import WorkflowConfig
from gateway.core.contexts import session_key, workflow_key
from gateway.core.errors import ErrorKind, GatewayError
from gateway.core.facts import StageBegan
from gateway.core.inference_api import InferenceRequest, Metadata
from gateway.load.ledger import Dispatch, InFlightLedger
from gateway.load.pressure_modes import PressureMode
from gateway.pressure.monitor import next_mode
from gateway.workflow.context import ContextSignals, WorkflowContext
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import ActionKind, WorkflowTracker

parse_workflow_context = ContextSignals().parse


def ctx(stage: str, **kw) -> WorkflowContext:
    return WorkflowContext(workflow_id="wf", stage_id=stage, **kw)


class LedgerTracker(WorkflowTracker):
    """The tracker as the request pipeline drives it: the ledger records each request before the tracker
    hears of it, and forgets it before the tracker hears it finished."""

    def __init__(self, config: WorkflowConfig) -> None:
        self.ledger = InFlightLedger()
        super().__init__(config, self.ledger)
        self._running: dict[str, Dispatch] = {}

    def dispatch(self, plan, request_id, pod, model, now=None):
        wf, stage = plan.workflow, plan.stage
        self._running[request_id] = self.ledger.dispatch(
            request_id, pod, 0.0, "chat", context=workflow_key(wf.id) if wf else None,
            stage=(wf.id, stage.id) if wf and stage else None)
        return self.dispatched(plan, pod, model, now)

    def finish(self, request_id, pod, plan, tokens=None, now=None):
        self.ledger.finish(self._running.pop(request_id))
        return self.finished(plan, pod, tokens, now)


def run_stage(tracker, stage, tokens, pod="a", model="m", request_id=None, finish=True, **kw):
    plan = tracker.begin(ctx(stage, **kw), model, tokens)
    flushes = tracker.dispatch(plan, request_id or f"{stage}-r", pod, model)
    done = tracker.finish(request_id or f"{stage}-r", pod, plan, tokens) if finish else []
    return plan, flushes, done


@pytest.fixture
def tracker() -> LedgerTracker:
    return LedgerTracker(WorkflowConfig(preserve_threshold_tokens=100))


def test_first_stage_is_noop_then_small_increment_preserves(tracker):
    plan, _, _ = run_stage(tracker, "s1", 1000)
    assert plan.action.kind is ActionKind.NOOP
    plan, _, _ = run_stage(tracker, "s2", 1080)
    assert (plan.action.kind, plan.action.reason, plan.action.pod) == (ActionKind.PRESERVE, "small_increment", "a")
    assert tracker.workflows["wf"].entries["a"].preserved


def test_stages_begun_elsewhere_keep_their_order_whichever_fact_arrives_first(tracker):
    """Two replicas began s1 then s2 (then s3); a third hears of them from two senders, s2 first: it lists
    them in the order they began, and s2's previous stage is s1 there too."""
    facts: list[StageBegan] = []
    one, two = WorkflowTracker(tracker.config, InFlightLedger(), facts.append), \
        WorkflowTracker(tracker.config, InFlightLedger(), facts.append)
    one.begin(ctx("s1"), "m", 1000)
    two.apply_remote("one", facts[0])
    two.begin(ctx("s2"), "m", 1100)
    one.apply_remote("two", facts[1])
    one.begin(ctx("s3"), "m", 1200)
    assert [f.after for f in facts] == [None, "s1", "s2"]
    for fact in (facts[2], facts[1], facts[0]):
        tracker.apply_remote("elsewhere", fact)
    wf = tracker.workflows["wf"]
    assert wf.order == ["s1", "s2", "s3"] and wf.previous_stage("s2") is wf.stages["s1"]
    fresh = LedgerTracker(tracker.config)
    for fact in (facts[1], facts[0], facts[2]):
        fresh.apply_remote("elsewhere", fact)
    assert fresh.workflows["wf"].order == ["s1", "s2", "s3"]


def test_large_increment_is_noop_and_threshold_header_overrides(tracker):
    run_stage(tracker, "s1", 1000)
    plan, _, _ = run_stage(tracker, "s2", 1500)
    assert plan.action.kind is ActionKind.NOOP
    plan, _, _ = run_stage(tracker, "s3", 2000, preserve_threshold=600)
    assert plan.action.kind is ActionKind.PRESERVE


def test_model_change_flushes_the_pod_it_leaves(tracker):
    run_stage(tracker, "s1", 1000, pod="a")
    plan, flushes, _ = run_stage(tracker, "s2", 1010, pod="b", model="other")
    assert (plan.action.kind, plan.action.reason, plan.action.pod) == (ActionKind.FLUSH, "model_changed", "a")
    assert [(f.kind, f.pod) for f in flushes] == [(ActionKind.FLUSH, "a")]


def test_overrides_win(tracker):
    run_stage(tracker, "s1", 1000, pod="a")
    plan, _, _ = run_stage(tracker, "s2", 5000, cache_policy="preserve")
    assert (plan.action.kind, plan.action.reason, plan.action.pod) == (ActionKind.PRESERVE, "override", "a")
    plan, _, _ = run_stage(tracker, "s3", 5010, cache_policy="flush")
    assert (plan.action.kind, plan.action.reason, plan.action.pod) == (ActionKind.FLUSH, "override", "a")


def test_leaving_a_preserved_pod_flushes_it(tracker):
    run_stage(tracker, "s1", 1000, pod="a")
    run_stage(tracker, "s2", 1010, pod="a")  # preserved on a
    _, flushes, _ = run_stage(tracker, "s3", 1020, pod="b")  # routing fell back to b (a unavailable)
    assert [(f.reason, f.pod) for f in flushes] == [("left_pod", "a")]
    assert not tracker.workflows["wf"].entries["a"].preserved


def test_same_stage_requests_stay_with_the_stage(tracker):
    run_stage(tracker, "s1", 1000, pod="a")
    run_stage(tracker, "s2", 1010, pod="a")
    plan = tracker.begin(ctx("s2"), "m", 1010)
    assert (plan.action.kind, plan.action.reason, plan.action.pod) == (ActionKind.PRESERVE, "same_stage", "a")


def test_completion_waits_for_in_flight_then_flushes_every_pod(tracker):
    run_stage(tracker, "s1", 1000, pod="a")
    plan = tracker.begin(ctx("s2", complete=True), "m", 1010)
    tracker.dispatch(plan, "last", "b", "m")
    assert tracker.complete("wf") == []  # still in flight: completes when it finishes
    done = tracker.finish("last", "b", plan, 1010)
    assert sorted((a.reason, a.pod) for a in done) == [("workflow_complete", "a"), ("workflow_complete", "b")]
    assert "wf" not in tracker.workflows


def test_idle_workflows_expire(tracker):
    tracker.config = WorkflowConfig(idle_ttl_s=10)
    plan = tracker.begin(ctx("s1"), "m", 100, now=0.0)
    tracker.dispatch(plan, "r", "a", "m", now=0.0)
    tracker.finish("r", "a", plan, 100, now=1.0)
    assert tracker.expire_idle(now=5.0) == []
    assert [(a.reason, a.pod) for a in tracker.expire_idle(now=20.0)] == [("idle_expired", "a")]


def test_in_flight_queries(tracker):
    plan = tracker.begin(ctx("s1"), "m", 100)
    tracker.dispatch(plan, "r1", "a", "m")
    other = tracker.begin(WorkflowContext(workflow_id="other", stage_id="x"), "m", 100)
    tracker.dispatch(other, "r2", "a", "m")
    assert tracker.ledger.others_on("a", "wf") and not tracker.ledger.others_on("b", "wf")
    tracker.finish("r2", "a", other, 100)
    assert not tracker.ledger.others_on("a", "wf")
    run_stage(tracker, "s2", 110, pod="a", request_id="r3")
    assert tracker.idle_preserved("a") == []  # wf still has r1 in flight
    tracker.finish("r1", "a", plan, 100)
    assert [w.id for w in tracker.idle_preserved("a")] == ["wf"]


@pytest.mark.parametrize(("start", "usages", "modes"), [
    (PressureMode.RELAXED, [0.5, 0.72, 0.86, 0.93, 0.97], ["RELAXED", "NORMAL", "PRESSURE", "CRITICAL", "EMERGENCY"]),
    # Down only once usage is 0.03 below the threshold it crossed going up.
    (PressureMode.PRESSURE, [0.84, 0.83, 0.81, 0.69, 0.66], ["PRESSURE", "PRESSURE", "NORMAL", "NORMAL", "RELAXED"]),
    (PressureMode.EMERGENCY, [0.95, 0.92, 0.5], ["EMERGENCY", "CRITICAL", "RELAXED"]),
])
def test_pressure_modes_with_hysteresis(start, usages, modes):
    thresholds, mode, seen = [0.70, 0.85, 0.92, 0.96], start, []
    for usage in usages:
        mode = next_mode(mode, usage, thresholds, 0.03)
        seen.append(mode.name)
    assert seen == modes


def test_sessions_bounded_but_in_flight_never_evicted():
    ledger = InFlightLedger()
    sessions = SessionAffinity(ledger, max_sessions=2)

    def started(key: str, pod: str) -> Dispatch:
        running = ledger.dispatch(f"{key}-r", pod, 0.0, "chat", context=session_key(key))
        sessions.started(key, pod)
        return running

    started("busy", "a")  # stays in flight
    ledger.finish(started("s1", "b"))
    ledger.finish(started("s2", "c"))
    assert sessions.pod_of("busy") == "a" and sessions.pod_of("s1") is None and sessions.pod_of("s2") == "c"
    started("s3", "a")
    assert sessions.pod_of("busy") == "a" and len(sessions) == 2


def headers(**values: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in values.items()}))


def test_context_from_headers_aliases_and_body():
    parsed = parse_workflow_context(headers(x_orla_workflow_run="run-1", x_orla_stage="plan",
                                            x_stage_cache_policy="Preserve", x_workflow_complete="true",
                                            x_stage_preserve_threshold="50"), InferenceRequest(model="m"))
    assert (parsed.workflow_id, parsed.stage_id, parsed.cache_policy, parsed.complete,
            parsed.preserve_threshold) == ("run-1", "plan", "preserve", True, 50)
    body = InferenceRequest(model="m", metadata=Metadata(workflow_id="w2", stage_id="s9"), prompt_cache_key="k")
    parsed = parse_workflow_context(headers(), body)
    assert (parsed.workflow_id, parsed.stage_id, parsed.session_id) == ("w2", "s9", "k")
    assert parse_workflow_context(headers(x_session_id="sess"), InferenceRequest(model="m", user="u")).session_id \
        == "sess"
    for bad in ({"x_stage_cache_policy": "keep"}, {"x_stage_preserve_threshold": "lots"}):
        with pytest.raises(GatewayError) as info:
            parse_workflow_context(headers(**bad), InferenceRequest(model="m"))
        assert info.value.kind is ErrorKind.INVALID_REQUEST


def raw_headers(values: dict[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(values))


@pytest.mark.parametrize(("sent", "body", "key"), [
    ({"X-Claude-Code-Session-Id": "cc-1"}, {}, "session:cc-1"),
    ({"X-Claude-Code-Session-Id": "cc-1", "X-Claude-Code-Agent-Id": "a7"}, {}, "session:cc-1/agent:a7"),
    ({"X-Qwen-Code-Session-Id": "qw-1"}, {}, "session:qw-1"),
    ({"session_id": "codex-1", "conversation_id": "codex-1"}, {"prompt_cache_key": "codex-1"}, "session:codex-1"),
    ({"conversation_id": "codex-2"}, {}, "session:codex-2"),
    ({"session-id": "s"}, {}, "session:s"), ({"thread-id": "t"}, {}, "session:t"),
    ({}, {"prompt_cache_key": "pck"}, "session:pck"),
    ({}, {"metadata": Metadata(user_id="user_ab_account_cd_session_ef")}, "session:user_ab_account_cd_session_ef"),
    ({}, {"user": "alice"}, "session:alice"),
    ({"x-session-id": "mine", "X-Claude-Code-Session-Id": "cc"}, {"user": "alice"}, "session:mine"),  # first wins
    ({"X-Claude-Code-Session-Id": "cc"}, {"prompt_cache_key": "pck", "user": "alice"}, "session:cc"),
    ({"x-workflow-id": "wf", "x-session-id": "s"}, {}, "workflow:wf"),
    ({"X-Claude-Code-Agent-Id": "a7"}, {}, None),  # an agent id alone names no session
    ({"X-Claude-Code-Session-Id": "  "}, {"user": "bob"}, "session:bob"),  # blank is absent
    ({}, {}, None),
])
def test_agent_tools_session_signals_map_to_one_context_each(sent, body, key):
    assert ContextSignals().context_key(raw_headers(sent), InferenceRequest(model="m", **body)) == key


def test_session_ids_match_exactly_and_configured_headers_come_after_the_builtin_ones():
    signals = ContextSignals(extra_headers=["X-My-Agent-Run"])
    keys = {signals.context_key(raw_headers({"x-session-id": sid}), InferenceRequest(model="m"))
            for sid in ("abc", "abc-1", "ABC", "abc ")}
    assert keys == {"session:abc", "session:abc-1", "session:ABC"}  # "abc " is "abc", trimmed
    assert signals.context_key(raw_headers({"x-my-agent-run": "r1"}), InferenceRequest(model="m")) == "session:r1"
    assert signals.context_key(raw_headers({"x-my-agent-run": "r1", "thread-id": "t"}),
                               InferenceRequest(model="m")) == "session:t"
    assert ContextSignals().context_key(raw_headers({"x-my-agent-run": "r1"}), InferenceRequest(model="m")) is None
