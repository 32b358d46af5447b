"""The request pipeline, a step at a time: what each step reads and what it returns or fills, table by
table; then the director's stage order, retries and the one record it makes of a request."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from gateway.api.http_edge import HttpEdge
from gateway.auth import ApiKeyAuth
from gateway.config import (
    AuthConfig,
    HealthConfig,
    ModelTokenizerConfig,
    PlacementConfig,
    PodConfig,
    ServerConfig,
    TokenizationConfig,
    VerificationConfig,
    WorkflowConfig,
    hash_api_key,
)
from gateway.core.errors import ErrorKind, GatewayError, upstream_failed
from gateway.core.inference_api import RequestKind, parse_inference_request
from gateway.core.usage import PromptTokensDetails, Usage
from gateway.http_client import HttpClient
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.index import PrefixIndex
from gateway.kv.verification import PredictionVerifier
from gateway.kv.views import PodMatch
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.load.pressure_modes import PressureModes
from gateway.load.slo_profiles import ProfileStore
from gateway.logs import ACCESS_LOGGER
from gateway.metrics import GatewayMetrics
from gateway.plugin_registry import PluginRegistry
from gateway.pods.registry import PodRegistry
from gateway.proxy.outcome import Ending, RelayOutcome, RetryableFailure
from gateway.request.context_steps import (
    ContextPlacement,
    ContextResolution,
    PlacementLosses,
    PlacementMetrics,
    RoomForNewContexts,
    RoutedPrefix,
)
from gateway.request.director import NoPlanner, RequestDirector
from gateway.request.observers import AccessLog, OutputLearning, PredictionCheck, RequestMetrics, RoutingMetrics
from gateway.request.pipeline import RequestPipeline
from gateway.request.steps import LoadEstimation, PromptTokenization, WorkflowPlanning
from gateway.request.types import Admitted, Attempt, ClientRequest, CompletedRequest
from gateway.request.validation import RequestValidation
from gateway.routing.policy import Decision, Policy, PolicyContext, PrefixMatch, RoutingRequest
from gateway.routing.router import Router
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.actions import CacheActionExecutor
from gateway.workflow.context import ContextSignals
from gateway.workflow.metrics import WorkflowMetrics
from gateway.workflow.planning import NO_PLAN, WorkflowService
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import WorkflowTracker

MODEL = "mock-llama"
BS = 16


def pods(n: int = 2) -> PodRegistry:
    registry = PodRegistry([PodConfig(url=f"http://p{i}:1", name=f"p{i}", models=[MODEL]) for i in range(n)],
                           HealthConfig())
    for pod in registry.all():
        pod.healthy = True
    return registry


def client_request(body: dict[str, Any] | bytes, kind: str = "chat", headers: dict[str, str] | None = None,
                   key: Any = None) -> ClientRequest:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return ClientRequest("req-1", RequestKind(kind), time.monotonic(), raw, parse_inference_request(raw), key,
                         CIMultiDict(headers or {}), "POST", "/v1/chat/completions")


def chat(content: str = "Hello there", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def routing_of(request: ClientRequest, **fields: Any) -> RoutingRequest:
    return RoutingRequest(request.id, request.model, request.kind, request.parsed, base_model=request.model, **fields)


def policy(needs_tokens: bool = True, needs_load: bool = False) -> Policy:
    return Policy("test", picker=None, needs_tokens=needs_tokens, needs_load=needs_load)  # type: ignore[arg-type]


# A policy that places nothing itself (round robin's kind), and one whose placement keeps contexts (kv_aware's).
ROUND_ROBIN = Policy("round_robin", picker=None)  # type: ignore[arg-type]
PLACES_CONTEXTS = Policy("kv_aware", picker=None, needs_tokens=True, places_contexts=True)  # type: ignore[arg-type]


def attempt_of(request: ClientRequest, routing: RoutingRequest, pod: str = "p0", registry: PodRegistry | None = None,
               ledger: InFlightLedger | None = None, plan: Any = NO_PLAN, reason: str = "cache_hit") -> Attempt:
    registry = registry or pods()
    ledger = ledger or InFlightLedger()
    decision = Decision(registry.get(pod), "kv_aware", reason, prefix_tokens=routing.prefix_tokens.get(pod, 0))
    dispatch = ledger.dispatch(request.id, pod, 0.1, request.kind, context=routing.context_key)
    return Attempt(request, policy(), routing, plan, decision, dispatch, 0, time.monotonic(), {})


def completed(request: ClientRequest, status: int = 200, outcome: RelayOutcome | None = None,
              routing: RoutingRequest | None = None, last: Attempt | None = None,
              admitted: Admitted | None = None) -> CompletedRequest:
    return CompletedRequest(request, status, time.monotonic(), 1 if last else 0, routing, admitted, last, outcome)


# resolve: RequestValidation


@pytest.mark.parametrize(("body", "kind", "key", "error"), [
    (chat(), "chat", None, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 4}, "chat", None, "too_many_messages"),
    (chat(model="other"), "chat", None, "model_not_found"),
    (chat(), "chat", "sk-other-models", "model_not_allowed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "messages", None, "invalid_request"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "count_tokens", None, None),
    ({**chat(), "system": 5}, "messages", None, "invalid_request"),
])
def test_validation_refuses_what_no_pod_should_see(body, kind, key, error):
    auth = ApiKeyAuth(msgspec.convert({"keys": [{"hash": hash_api_key("sk-other-models"), "models": ["other"]}]},
                                      AuthConfig))
    step = RequestValidation(pods(), auth, ServerConfig(max_messages=3))
    request = client_request(body, kind, key=auth.check({"authorization": f"Bearer {key}"}) if key else None)
    if error is None:
        assert step.resolve(request) is None
    else:
        with pytest.raises(GatewayError) as info:
            step.resolve(request)
        assert info.value.code == error


# prepare: PromptTokenization


@pytest.fixture(scope="module")
def tokens() -> TokenizationService:
    service = TokenizationService(
        TokenizationConfig(models={MODEL: ModelTokenizerConfig(path=str(BUNDLED_TOKENIZER_DIR))}),
        PodRegistry([], HealthConfig()), GatewayMetrics(), HttpClient(), InFlightLedger())
    service.load()
    return service


@pytest.mark.parametrize(("needs_tokens", "content", "outcome"), [
    (False, "Hello there", "skipped"),
    (True, "Hello there", "tokenized"),
    (True, "word " * 200, "context_length_exceeded"),
])
async def test_tokenization_fills_the_token_ids_or_refuses_a_prompt_too_long(tokens, tokenizer, needs_tokens, content,
                                                                             outcome):
    step = PromptTokenization(pods(), tokens, PredictionVerifier(VerificationConfig(), GatewayMetrics()),
                              ServerConfig(max_prompt_tokens=64))
    request = client_request(chat(content))
    routing = routing_of(request)
    waiting = step.prepare(request, policy(needs_tokens=needs_tokens), routing)
    if outcome == "skipped":
        assert waiting is None and routing.token_ids is None
        return
    assert waiting is not None
    if outcome == "tokenized":
        await waiting
        assert list(routing.token_ids) == tokenizer.encode_chat(request.parsed.messages)
    else:
        with pytest.raises(GatewayError) as info:
            await waiting
        assert info.value.code == outcome


# prepare: ContextResolution


class Contexts:
    def __init__(self) -> None:
        self.pods = pods()
        self.index = PrefixIndex()
        for pod in self.pods.all():
            self.index.view(pod.name, 0, MODEL, BS)
        self.ledger = InFlightLedger()
        self.working_set = ResumableWorkingSet(PlacementConfig(), self.ledger, anonymous_prefix="anon-")
        self.step = ContextResolution(self.pods, self.index, self.working_set, ContextSignals())

    def resolve(self, token_ids: list[int] | None, headers: dict[str, str] | None = None,
                **body: Any) -> RoutingRequest:
        request = client_request(chat(**body), headers=headers)
        routing = routing_of(request, token_ids=token_ids,  # with their hashes, as tokenization makes them
                             hashes=self.index.prompt_hashes(MODEL, None, token_ids) if token_ids else None)
        self.step.prepare(request, policy(), routing)
        return routing


@pytest.mark.parametrize(("headers", "body", "key", "keyed"), [
    ({"x-workflow-id": "wf"}, {}, "workflow:wf", True),
    ({"x-session-id": "s"}, {}, "session:s", True),
    ({}, {"prompt_cache_key": "pck"}, "session:pck", True),
    ({}, {"user": "u"}, "session:u", True),
    ({}, {}, "anon-0", False),  # a tokenized prompt no live conversation continues: a new one
])
def test_context_resolution_names_the_context(headers, body, key, keyed):
    routing = Contexts().resolve(list(range(48)), headers, **body)
    assert (routing.context_key, routing.context_keyed) == (key, keyed)


def test_context_resolution_recognises_a_continued_conversation_and_nothing_without_tokens():
    contexts = Contexts()
    first = contexts.resolve(list(range(48)))
    hashes = first.hashes.first(BS, 3)
    contexts.working_set.hold(first.context_key, False, "p0", BS, hashes, 48, now=0.0)
    assert contexts.resolve(list(range(48)) + list(range(100, 120))).context_key == first.context_key
    assert contexts.resolve(list(range(1000, 1048))).context_key != first.context_key
    untokenized = contexts.resolve(None)
    assert untokenized.context_key is None and untokenized.hashes is None


# prepare: LoadEstimation (admit: FlowControlStep, in test_flow_control.py)


@pytest.mark.parametrize(("admission", "needs_load", "estimated"), [
    (False, False, False), (True, False, True), (False, True, True),
])
def test_load_estimation_runs_when_admission_or_the_policy_needs_it(admission, needs_load, estimated):
    registry = pods(3)
    ledger = InFlightLedger()
    step = LoadEstimation(registry, PendingLoad(ProfileStore(None), ledger, 4, str), OutputLengthPredictor(),
                          GatewayMetrics(), admission)
    request = client_request(chat(max_tokens=100))
    routing = routing_of(request, token_ids=list(range(40)))
    step.prepare(request, policy(needs_load=needs_load), routing)
    if not estimated:
        assert routing.estimates == {} and routing.input_tokens == 0
        return
    assert routing.input_tokens == 40 and routing.predicted_output_tokens > 0
    assert set(routing.estimates) == {"p0", "p1", "p2"}


async def test_room_for_new_contexts_holds_a_new_session_until_a_pod_has_room():
    contexts = Contexts()
    for n, pod in enumerate(("p0", "p1")):  # each pod's cache (100 tokens) is mostly held by a thinking session
        blocks = list(range(10 * n, 10 * n + 6))  # 96 tokens
        contexts.working_set.hold(f"session:{pod}", True, pod, BS, blocks, 96, now=time.monotonic())
        contexts.working_set.idle(f"session:{pod}", now=time.monotonic())
    metrics = GatewayMetrics()
    step = RoomForNewContexts(contexts.pods, contexts.working_set, lambda pod: 100.0, 2.0, metrics)
    continuing = contexts.resolve(list(range(48)), {"x-session-id": "p0"})
    assert step.admit(client_request(chat()), policy(), continuing) is None  # a context that continues never waits
    fresh = contexts.resolve(list(range(48)), {"x-session-id": "new"})
    waiting = step.admit(client_request(chat()), policy(), fresh)
    assert waiting is not None
    started = time.monotonic()
    asyncio.get_running_loop().call_later(0.2, contexts.working_set.release, "session:p1")
    await waiting
    assert 0.2 <= time.monotonic() - started < 1.0  # room opened on p1: it went on long before its 2 s
    assert metrics.owned(PlacementMetrics).admission.labels("held", "no_room_for_new_context")._value.get() == 1
    assert step.admit(client_request(chat()), policy(), fresh) is None  # now there is room


# plan, dispatch, finish: WorkflowPlanning


def workflow_planning(ledger: InFlightLedger, registry: PodRegistry) -> tuple[WorkflowTracker, WorkflowPlanning]:
    tracker = WorkflowTracker(WorkflowConfig(preserve_threshold_tokens=100), ledger)
    executor = CacheActionExecutor(tracker, ResumableWorkingSet(PlacementConfig(), ledger), registry,
                                   GatewayMetrics().owned(WorkflowMetrics), lambda pod: None, HttpClient(),
                                   hard_flush=False)
    return tracker, WorkflowPlanning(WorkflowService(WorkflowConfig(), tracker, SessionAffinity(ledger), executor,
                                                     PressureModes(), ContextSignals()))


def test_workflow_planning_plans_records_where_a_stage_went_and_what_it_ended_with():
    ledger, registry = InFlightLedger(), pods()
    tracker, step = workflow_planning(ledger, registry)
    first = client_request(chat("stage one"), headers={"x-workflow-id": "wf", "x-stage-id": "s1"})
    routing = routing_of(first, token_ids=list(range(1000)), context_key="workflow:wf")
    plan = step.plan(first, ROUND_ROBIN, routing)
    assert plan.stage_owner == ("wf", "s1") and plan.pin is None
    attempt = attempt_of(first, routing, "p1", registry, ledger, plan)
    step.dispatched(attempt)
    ledger.finish(attempt.dispatch)
    step.attempt_finished(attempt, RelayOutcome(200, Ending.COMPLETE, usage=Usage(prompt_tokens=1000)))
    assert tracker.workflows["wf"].stages["s1"].pod == "p1"
    second = client_request(chat("stage two"), headers={"x-workflow-id": "wf", "x-stage-id": "s2"})
    plan = step.plan(second, ROUND_ROBIN, routing_of(second, token_ids=list(range(1050))))
    assert (plan.pin, plan.pin_reason) == ("p1", "workflow_preserve")  # a small increment stays with its cache
    assert plan.pin_binding
    assert plan.header_for(Decision(registry.get("p1"), "round_robin", "pinned")) == "preserve:small_increment"


def test_a_policy_placing_contexts_itself_takes_the_workflows_pod_as_a_hint():
    ledger, registry = InFlightLedger(), pods()
    _, step = workflow_planning(ledger, registry)
    first = client_request(chat("stage one"), headers={"x-workflow-id": "wf", "x-stage-id": "s1"})
    routing = routing_of(first, token_ids=list(range(1000)), context_key="workflow:wf")
    attempt = attempt_of(first, routing, "p1", registry, ledger, step.plan(first, PLACES_CONTEXTS, routing))
    step.dispatched(attempt)
    ledger.finish(attempt.dispatch)
    step.attempt_finished(attempt, RelayOutcome(200, Ending.COMPLETE, usage=Usage(prompt_tokens=1000)))
    # kv_aware keeps a continuing stage with its cache, weighing load as it does: the workflow's pod is a hint
    # its filters see, and the answer says when placement chose another pod.
    second = client_request(chat("stage two"), headers={"x-workflow-id": "wf", "x-stage-id": "s2"})
    hinted = step.plan(second, PLACES_CONTEXTS, routing_of(second, token_ids=list(range(1050))))
    assert (hinted.pin, hinted.pin_binding) == ("p1", False)
    moved = Decision(registry.get("p0"), "kv_aware", "cache_hit", unpinned="p1", unpinned_by="placement")
    assert hinted.header_for(moved) == "preserve-fallback:placement"
    assert hinted.header_for(Decision(registry.get("p1"), "kv_aware", "cache_hit")) == "preserve:small_increment"
    # A stage that asks to be preserved is pinned whatever the policy.
    asked = client_request(chat("stage three"), headers={"x-workflow-id": "wf", "x-stage-id": "s3",
                                                         "x-stage-cache-policy": "preserve"})
    assert step.plan(asked, PLACES_CONTEXTS, routing_of(asked, token_ids=list(range(1100)))).pin_binding


# dispatch, finish: ContextPlacement; dispatch: RoutedPrefix


def test_context_placement_holds_while_running_and_lets_the_context_think_after():
    contexts = Contexts()
    routing = contexts.resolve(list(range(48)), {"x-session-id": "s"})
    step = ContextPlacement(contexts.index, contexts.working_set, PlacementLosses(GatewayMetrics()), clock=lambda: 5.0)
    attempt = attempt_of(client_request(chat()), routing, "p1", contexts.pods, contexts.ledger)
    step.dispatched(attempt)
    held = contexts.working_set.context("session:s")
    assert held is not None and held.pod == "p1" and len(held.hashes) == 3 and not held.thinking
    contexts.ledger.finish(attempt.dispatch)
    step.attempt_finished(attempt, RelayOutcome.failed(502))
    assert held.thinking and held.last_finish == 5.0


def test_routed_prefix_records_what_the_chosen_pod_will_hold():
    contexts = Contexts()
    routing = contexts.resolve(list(range(48)))
    routing.prefix = PrefixMatch(True, routing.hashes, pods={})
    RoutedPrefix(contexts.index, ApproximatePrefixIndex()).dispatched(
        attempt_of(client_request(chat()), routing, "p1", contexts.pods))
    looked_up = contexts.index.lookup(MODEL, None, routing.hashes, ["p0", "p1"])
    assert looked_up["p1"].speculative_tokens == 32 and looked_up["p0"].gpu_tokens == 0  # last token never a hit
    approximate = ApproximatePrefixIndex(block_chars=8)
    text = routing_of(client_request(chat()), prefix=PrefixMatch(False, text="y" * 40))
    RoutedPrefix(contexts.index, approximate).dispatched(attempt_of(client_request(chat()), text, "p0", contexts.pods))
    assert approximate.lookup("y" * 40, ["p0", "p1"]) == {"p0": 40, "p1": 0}


# complete: the observers read the one record the director made


def test_routing_metrics_count_the_decision_and_its_prefix():
    metrics = GatewayMetrics()
    request = client_request(chat())
    routing = routing_of(request, token_ids=list(range(64)), prefix_tokens={"p0": 48})
    RoutingMetrics(metrics).dispatched(attempt_of(request, routing))
    assert metrics.registry.get_sample_value("gateway_routing_decisions_total",
                                             {"policy": "kv_aware", "reason": "cache_hit"}) == 1
    assert metrics.registry.get_sample_value("gateway_prefix_hit_tokens_sum", {"policy": "kv_aware"}) == 48


@pytest.mark.parametrize(("status", "ending", "usage", "learnt"), [
    (200, Ending.COMPLETE, Usage(prompt_tokens=100, completion_tokens=7), True),
    (502, Ending.UPSTREAM_BROKE, None, False),  # a cut stream is no output length
    (499, Ending.CLIENT_GONE, None, False),
    (400, Ending.COMPLETE, None, False),
])
def test_output_learning_learns_only_from_whole_answers(status, ending, usage, learnt):
    metrics, predictor = GatewayMetrics(), OutputLengthPredictor()
    request = client_request(chat())
    routing = routing_of(request, predicted_output_tokens=4)
    OutputLearning(predictor, metrics).completed(
        completed(request, status, RelayOutcome(status, ending, time.monotonic(), usage, streamed_events=9), routing))
    assert (metrics.registry.get_sample_value("gateway_output_tokens_count", {"kind": "actual"}) or 0) == learnt


def test_prediction_check_compares_the_confirmed_prefix_with_the_engines_count():
    metrics = GatewayMetrics()
    verifier = PredictionVerifier(VerificationConfig(), metrics)
    request = client_request(chat())
    match = PrefixMatch(True, pods={"p0": PodMatch(gpu_tokens=48, speculative_tokens=16)})
    routing = routing_of(request, token_ids=list(range(64)), prefix=match)
    outcome = RelayOutcome(200, Ending.COMPLETE, usage=Usage(prompt_tokens=64,
                                                             prompt_tokens_details=PromptTokensDetails(32)))
    PredictionCheck(verifier).completed(completed(request, 200, outcome, routing, attempt_of(request, routing)))
    # 48 predicted of which 16 only speculative: 32 confirmed, as the engine says.
    assert metrics.registry.get_sample_value("gateway_kv_prediction_exact_total",
                                             {"model": MODEL, "pod": "p0", "outcome": "exact"}) == 1


def test_request_metrics_and_access_log_record_the_status_the_director_decided(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    metrics = GatewayMetrics()
    request = client_request(chat())
    routing = routing_of(request)
    done = completed(request, 502, RelayOutcome(502, Ending.UPSTREAM_BROKE, time.monotonic()), routing,
                     attempt_of(request, routing))
    RequestMetrics(metrics, lambda model: model == MODEL).completed(done)
    AccessLog().completed(done)
    labels = {"model": MODEL, "pod": "p0", "status": "502", "route": "/v1/chat/completions",
              "outcome": "upstream_broke"}
    assert metrics.registry.get_sample_value("gateway_requests_total", labels) == 1
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert (record.status, record.pod, record.ending) == (502, "p0", "upstream_broke")


# The director: stage order, retries, and the one record


class Recorder:
    """A step at every extension point, writing down what it saw."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def prepare(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> None:
        self.log.append("prepare")

    def admit(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> Any:
        self.log.append("admit")
        return None

    def plan(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> Any:
        self.log.append("plan")
        return NO_PLAN

    def dispatched(self, attempt: Attempt) -> None:
        self.log.append(f"dispatch {attempt.decision.pod.name} #{attempt.number}")

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        self.log.append(f"finish {attempt.decision.pod.name} {outcome.status} {outcome.ending.value}")

    def completed(self, done: CompletedRequest) -> None:
        self.log.append(f"complete {done.status} attempts={done.attempts}")
        self.done = done


class ScriptedProxy:
    """Answers each forward with the next scripted result: a relay outcome, or an exception to raise."""

    def __init__(self, log: list[str], ledger: InFlightLedger, script: list[Any]) -> None:
        self.log, self.ledger, self.script = log, ledger, script

    def upstream_headers(self, incoming: Any, request_id: str) -> dict[str, str]:
        return {"x-request-id": request_id}

    async def forward(self, call: Any, client: web.Request) -> tuple[web.StreamResponse, RelayOutcome]:
        self.log.append(f"forward {call.pod.name} in_flight={self.ledger.on_pod(call.pod.name)}")
        result = self.script.pop(0)
        if isinstance(result, BaseException):
            raise result
        return web.Response(status=200), result


def director(script: list[Any]) -> tuple[RequestDirector, list[str], Recorder]:
    log: list[str] = []
    registry, ledger = pods(), InFlightLedger()
    recorder = Recorder(log)
    router = Router(registry, PluginRegistry("gateway.policies", "routing policy"), "round_robin", {},
                    PolicyContext.standalone(registry, ledger=ledger))
    pipeline = RequestPipeline(prepare=[recorder], admit=[recorder], dispatch=[recorder], finish=[recorder],
                               complete=[recorder])
    proxy = ScriptedProxy(log, ledger, script)
    return (RequestDirector(pipeline, router, recorder, ledger, proxy, registry,  # type: ignore[arg-type]
                            max_retries=2, default_consumption=0.1, allow_strategy_header=True,
                            max_body_bytes=1 << 20), log, recorder)


def http_request(body: dict[str, Any]) -> web.Request:
    payload = msgspec.json.encode(body)
    request = make_mocked_request("POST", "/v1/chat/completions",
                                  headers=CIMultiDict({"content-length": str(len(payload))}))

    async def read() -> bytes:
        return payload

    request.read = read  # type: ignore[method-assign]
    return request


async def test_the_director_runs_the_stages_in_order_and_retries_before_the_first_byte():
    broken_stream = RelayOutcome(502, Ending.UPSTREAM_BROKE, time.monotonic(), streamed_events=3)
    the_director, log, recorder = director([RetryableFailure(upstream_failed("refused"), "connect"), broken_stream])
    edge = HttpEdge(http_request(chat()), the_director._proxy)  # type: ignore[arg-type]
    await the_director.handle(edge, RequestKind.CHAT, None)
    assert edge.response is not None and edge.response.status == 200  # what the client saw first ...
    assert log == [
        "prepare", "admit", "plan",
        "dispatch p0 #0", "forward p0 in_flight=1", "finish p0 502 failed",  # the ledger counted it while sent
        "dispatch p1 #1", "forward p1 in_flight=1", "finish p1 502 upstream_broke",
        "complete 502 attempts=2",  # ... and what is recorded: the stream broke
    ]
    assert recorder.done.outcome is broken_stream and recorder.done.decision.pod.name == "p1"


async def test_the_director_records_a_refusal_before_routing_and_after_every_pod_failed():
    refusing, log, recorder = director([])
    with pytest.raises(GatewayError) as info:
        await refusing.handle(HttpEdge(http_request({"model": MODEL, "max_tokens": -1}), refusing._proxy),
                              RequestKind.CHAT, None)
    assert info.value.kind is ErrorKind.INVALID_REQUEST and log == ["complete 400 attempts=0"]
    assert recorder.done.routing is None and recorder.done.model == "-"  # a body not understood names nothing
    failing, log, recorder = director([RetryableFailure(upstream_failed(f"pod {i} refused"), "connect")
                                       for i in range(3)])
    with pytest.raises(GatewayError) as info:
        await failing.handle(HttpEdge(http_request(chat()), failing._proxy), RequestKind.CHAT, None)
    assert info.value.kind is ErrorKind.UPSTREAM_FAILED and "pod 1" in info.value.message  # the last pod's cause
    assert log[-1] == "complete 502 attempts=2" and log.count("finish p0 502 failed") == 1
    assert NoPlanner().plan(recorder.done.request, ROUND_ROBIN, routing_of(recorder.done.request)) is NO_PLAN


@pytest.mark.parametrize(("held_on", "held_blocks", "hits", "chosen", "lost"), [
    (None, 0, {"p0": 32, "p1": 0}, "p1", ("new_off_best_prefix", 32)),  # the role prompt was on p0
    (None, 0, {"p0": 32, "p1": 32}, "p1", None),
    ("p0", 4, {"p0": 32, "p1": 0}, "p0", ("evicted_while_thinking", 32)),  # 2 of its 4 blocks gone
    ("p0", 4, {"p0": 64, "p1": 0}, "p0", None),
    ("p0", 4, {"p0": 48, "p1": 16}, "p1", ("moved_from_its_cache", 32)),
])
def test_placement_losses_say_where_hits_were_lost(held_on, held_blocks, hits, chosen, lost):
    losses = PlacementLosses(GatewayMetrics())
    request = client_request(chat())
    routing = routing_of(request, prefix=PrefixMatch(True, pods={p: PodMatch(n) for p, n in hits.items()}))
    context = None
    if held_on is not None:
        working_set = ResumableWorkingSet(PlacementConfig(), InFlightLedger())
        context = working_set.hold("session:s", True, held_on, BS, list(range(held_blocks)), held_blocks * BS, 0.0)
    losses.record(attempt_of(request, routing, chosen), context, BS)
    expected = {cause: {"requests": 0, "tokens": 0} for cause in PlacementLosses.CAUSES}
    if lost is not None:
        expected[lost[0]] = {"requests": 1, "tokens": lost[1]}
    assert losses.debug() == {"decisions": 1, "cached_tokens": hits[chosen], "lost": expected}
