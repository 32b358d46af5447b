"""The :class:`RequestDirector`: runs one client request through the pipeline's extension points.

Owner: the director alone builds the typed views the steps see (:mod:`gateway.request.types`), runs the
retry loop, writes the in-flight ledger (dispatch before an attempt is sent, finish when it ends), and
records how the request ended, once, from the outcome its edge returned, with the time of each of its
steps (:mod:`gateway.request.timings`: one clock reading at each step boundary). Everything a feature does
happens in a step (:mod:`gateway.request.pipeline`); an edge (:mod:`gateway.request.edge`: the HTTP
proxy, or Envoy through the endpoint picker) only reads the request and delivers each attempt. For a
model whose pods have roles, each attempt is the decode leg, and its prefill leg is run first by a
collaborator (:mod:`gateway.request.disaggregation`).

One request, phase by phase: read and parse (the edge's body), resolve (validation, a Responses
conversation's history), its model name resolved to the targets to try (:mod:`gateway.models.rules`: an
alias, a split's sticky target, then its fallbacks), then per target
prepare, admit, plan (once), then per attempt route, dispatch, deliver (the edge) and finish; a failure
before the first byte goes back to route, on another pod (behind Envoy, on the fallback endpoint the data
plane already took); a target that has no pod, would keep the request waiting longer than its rule allows,
or whose pods all failed before the first byte hands the request to the next target; then complete.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

from gateway.auth import ApiKey, owner_tag
from gateway.core.errors import GatewayError, upstream_failed
from gateway.core.inference_api import InferenceRequest, RequestKind, parse_inference_request
from gateway.http_errors import status_of
from gateway.load.ledger import InFlightLedger
from gateway.models.adapters import AdapterUnavailable
from gateway.models.rules import ModelRoute, ModelRules, as_is
from gateway.pods.registry import Pod, PodRegistry
from gateway.proxy.forward import Proxy
from gateway.proxy.outcome import Ending, RelayOutcome, RetryableFailure, UpstreamCall
from gateway.proxy.rewrite import AnswerRewrite, with_model
from gateway.request.disaggregation import PrefillLegs
from gateway.request.edge import Edge
from gateway.request.pipeline import RequestPipeline
from gateway.request.timings import Step, StepTimes, timed_as
from gateway.request.types import (
    ENGINE_PRIORITY_HEADER,
    Admitted,
    Attempt,
    ClientRequest,
    CompletedRequest,
    PrefillLeg,
)
from gateway.request.validation import check_content_type
from gateway.routing.policy import Decision, Policy, RoutingRequest
from gateway.routing.router import Router
from gateway.workflow.planning import NO_PLAN, RequestPlan

log = logging.getLogger("gateway.director")

# What the director knows of a body it could not read or parse: nothing.
_UNREAD = InferenceRequest()


class RequestPlanner(Protocol):
    """Plans a request before it is routed: its workflow cache action and the pod it is pinned to."""

    def plan(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> RequestPlan: ...


class AdapterRegistration(Protocol):
    """What the director asks of the adapter loader (:class:`gateway.models.adapters.AdapterLoader`): registers a
    request's LoRA adapter on the pod an attempt goes to, when the pod does not list it yet;
    raises :class:`AdapterUnavailable` when it cannot (the request then tries another pod)."""

    def needed(self, routing: RoutingRequest, pod: Pod) -> bool: ...

    async def ready(self, routing: RoutingRequest, pod: Pod) -> None: ...


# What a target's failure is, when the next target may take the request instead: it has no pod, or its
# requests would wait too long for one (flow control's limit, or the rule's ``fallback_wait_s``).
_FALLBACK_CODES = frozenset({"no_healthy_pod", "queue_timeout", "queue_full", "target_saturated",
                             "slo_unreachable"})


class _TargetFailed(Exception):
    """This target cannot serve the request (``error`` says why); the next one may."""

    def __init__(self, error: GatewayError, cause: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.cause = cause


class NoPlanner:
    """For requests that belong to no workflow (Anthropic's count_tokens)."""

    def plan(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> RequestPlan:
        return NO_PLAN


class RequestDirector:
    def __init__(self, pipeline: RequestPipeline, router: Router, planner: RequestPlanner, ledger: InFlightLedger,
                 proxy: Proxy, pods: PodRegistry, *, max_retries: int, default_consumption: float,
                 allow_strategy_header: bool, max_body_bytes: int, prefill: PrefillLegs | None = None,
                 models: ModelRules | None = None, adapters: AdapterRegistration | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pipeline = pipeline
        # The prepare steps (run again for each target), each with the step of the request's timings its time
        # counts to. What judges the request itself runs once, in resolve.
        self._prepare = tuple((step, timed_as(step)) for step in pipeline.prepare)
        # Public model names and their targets (none: every name is served as it is).
        self._models = models
        # LoRA adapters registered on demand (none: an adapter is routed only where a pod lists it).
        self._adapters = adapters
        self._router = router
        self._planner = planner
        self._ledger = ledger
        self._proxy = proxy
        self._pods = pods
        # Disaggregated models' prefill legs (none: every request is served whole by one pod).
        self._prefill = prefill
        self._max_retries = max_retries
        # What a request takes of a pod when nothing estimated it (no profile, no load-aware policy).
        self._default_consumption = default_consumption
        self._allow_strategy_header = allow_strategy_header
        self._max_body_bytes = max_body_bytes
        self._clock = clock
        # Request ids unique across replicas without the cost of uuid4 per request.
        self._id_prefix = os.urandom(6).hex()
        self._id_counter = itertools.count()

    async def handle(self, edge: Edge, kind: RequestKind, key: ApiKey | None) -> None:
        """Serve one request that ``edge`` received; how it ended is the edge's to answer (a
        :class:`GatewayError` raised here is the client's error, in the API's shape)."""
        headers = edge.headers
        request_id = self._identify(edge)
        started = self._clock()
        run = _Run(ClientRequest(request_id, kind, started, b"", _UNREAD, key, headers, edge.method, edge.path), edge)
        status = 500
        try:
            check_content_type(headers)  # before reading: a body that says it is not JSON is not read
            body = await edge.read_body(self._max_body_bytes)
            run.request = ClientRequest(request_id, kind, started, body, parse_inference_request(body), key, headers,
                                        edge.method, edge.path)
            for step in self._pipeline.resolve:
                if (resolved := step.resolve(run.request)) is not None:
                    run.request = resolved if isinstance(resolved, ClientRequest) else await resolved
            run.times.mark(Step.PARSE)
            await self._serve(run)
            assert run.outcome is not None  # an attempt that returns has delivered
            status = run.outcome.status
        except GatewayError as err:
            status = status_of(err)
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away first
            raise
        finally:
            done = CompletedRequest(run.request, status, self._clock(), run.attempts, run.routing, run.admitted,
                                    run.last, run.outcome, run.prefill, run.times, run.route, tuple(run.fallbacks))
            for step in self._pipeline.complete:
                step.completed(done)

    def refused(self, edge: Edge, kind: RequestKind, error: GatewayError) -> None:
        """A request turned away before it was handed over (its API key): recorded as any other, with the
        status it was answered with."""
        now = self._clock()
        request = ClientRequest(self._identify(edge), kind, now, b"", _UNREAD, None, edge.headers, edge.method,
                                edge.path)
        done = CompletedRequest(request, status_of(error), now, 0, steps=StepTimes())
        for step in self._pipeline.complete:
            step.completed(done)

    def _identify(self, edge: Edge) -> str:
        """The request's id: the client's ``x-request-id``, or one made here."""
        request_id = edge.headers.get("x-request-id") or f"{self._id_prefix}{next(self._id_counter):x}"
        edge.identified(request_id)
        return request_id

    async def _serve(self, run: _Run) -> None:
        request = run.request
        route = run.route = (self._models.route(request.model, request.kind, request.headers, request.parsed,
                                                owner_tag(request.key))
                             if self._models is not None else as_is(request.model))
        for target in route.targets:
            try:
                await self._serve_target(run, route, target)
                return
            except _TargetFailed as failed:
                if not route.fallback_after(target):
                    raise failed.error from None
                run.fallbacks.append((target, failed.cause))
                log.warning("request %s: target %s of %s cannot serve it (%s: %s); trying the next",
                            request.id, target, route.public, failed.cause, failed.error.message)

    async def _serve_target(self, run: _Run, route: ModelRoute, target: str) -> None:
        """Serve the request with one of its targets, or raise :class:`_TargetFailed` when that target
        cannot (and nothing reached the client)."""
        request = run.request
        policy, routing, plan = await self._ready_for(run, route, target)
        headers = self._proxy.upstream_headers(request.headers, request.id)
        # The body was read as JSON whatever type its client declared (none, or a +json one): vLLM takes it
        # only as application/json.
        headers["content-type"] = "application/json"
        exclude = self._excluded_pods(run)
        failure: RetryableFailure | None = None
        served_by: Pod | None = None  # where the data plane took the request after a failure
        tries = 0
        while failure is None or served_by is not None or tries <= self._max_retries:
            started = self._clock()
            if served_by is not None:
                decision = _fallback(served_by, policy, routing, exclude)
            else:
                decision = self._route(routing, policy, plan, exclude, failure)
            run.times.mark(Step.ROUTE)
            run.last = attempt = self._dispatch(run, policy, routing, plan, decision, started, headers)
            tries += 1
            try:
                await self._attempt(run, attempt, exclude, route)
                return
            except RetryableFailure as exc:
                failure, served_by = exc, exc.served_by
                exclude.add(decision.pod.name)
                log.warning("request %s: pod %s failed before the first byte (%s: %s)%s",
                            request.id, decision.pod.name, exc.cause, exc.error.message,
                            f"; the data plane took it to {served_by.name}" if served_by is not None else "")
        raise _TargetFailed(failure.error, "failed")

    async def _ready_for(self, run: _Run, route: ModelRoute, target: str
                         ) -> tuple[Policy, RoutingRequest, RequestPlan]:
        """The request resolved for ``target``, through its prepare and admit steps, and planned (once)."""
        request, times = run.request, run.times
        policy, routing = self._resolve(request, route, target)
        run.routing = routing
        run.body = request.body if target == request.model else with_model(request.body, request.model, target)
        for prepare, timed in self._prepare:
            if (waiting := prepare.prepare(request, policy, routing)) is not None:
                await waiting
            times.mark(timed)
        await self._admit(run, policy, routing)
        times.mark(Step.ADMIT)
        if run.plan is None:  # a workflow's stage begins once, whichever target serves it
            run.plan = self._planner.plan(request, policy, routing)
        return policy, routing, run.plan

    def _excluded_pods(self, run: _Run) -> set[str]:
        """The pods the request may not go to: those outside its key's allowed pods or its ``only_pod``."""
        allowed = run.edge.allowed_pods
        if run.request.only_pod is not None:
            only = run.request.only_pod
            allowed = frozenset({only} if allowed is None else {only} & allowed)
        return {p.name for p in self._pods.all() if p.name not in allowed} if allowed is not None else set()

    def _route(self, routing: RoutingRequest, policy: Policy, plan: RequestPlan, exclude: set[str],
               failure: RetryableFailure | None) -> Decision:
        """The router's pick among the pods not excluded; a target it finds no pod for is :class:`_TargetFailed`."""
        try:
            return self._router.route(routing, policy, frozenset(exclude), plan.pin, plan.pin_reason,
                                      binding=plan.pin_binding)
        except GatewayError as err:
            if failure:  # every pod we could try has failed: say why, not just "none left"
                raise _TargetFailed(failure.error, "failed") from None
            if err.code in _FALLBACK_CODES:
                raise _TargetFailed(err, "no_pod") from None
            raise

    def _dispatch(self, run: _Run, policy: Policy, routing: RoutingRequest, plan: RequestPlan, decision: Decision,
                  started: float, headers: dict[str, str]) -> Attempt:
        """The attempt on the decision's pod, written into the in-flight ledger before it is sent."""
        request = run.request
        estimate = routing.estimates.get(decision.pod.name)
        dispatch = self._ledger.dispatch(
            request.id, decision.pod.name, estimate.consumption if estimate else self._default_consumption,
            request.kind, context=routing.context_key, stage=plan.stage_owner,
            prefill_tokens=request.prompt_tokens(routing) - decision.prefix_tokens)
        attempt = Attempt(request, policy, routing, plan, decision, dispatch, run.attempts, started,
                          upstream_headers(headers, run.admitted, decision.pod),
                          run.body if run.body is not request.body else None,
                          routing.hashes.token_count if routing.untokenized_tokens and routing.hashes else None)
        run.attempts += 1
        return attempt

    async def _admit(self, run: _Run, policy: Policy, routing: RoutingRequest) -> None:
        """The admit steps, in order; a target that would keep the request waiting too long (or has no pod)
        is :class:`_TargetFailed`."""
        try:
            for admit in self._pipeline.admit:
                admitting = admit.admit(run.request, policy, routing)
                if isinstance(admitting, Admitted):
                    run.admitted = admitting
                elif admitting is not None and (admitted := await admitting) is not None:
                    run.admitted = admitted
        except GatewayError as err:
            if err.code in _FALLBACK_CODES:
                raise _TargetFailed(err, "saturated" if err.code != "no_healthy_pod" else "no_pod") from None
            raise

    def _resolve(self, request: ClientRequest, route: ModelRoute, target: str) -> tuple[Policy, RoutingRequest]:
        """The routing policy (the default, or ``x-routing-strategy`` where allowed) and the routing view
        of the request served by ``target``, which the prepare steps fill."""
        override = request.headers.get("x-routing-strategy") if self._allow_strategy_header else None
        base = self._pods.base_model(target)
        return self._router.resolve(override), RoutingRequest(
            request.id, target, request.kind, request.parsed, base_model=base,
            lora_name=target if base != target else None,
            leg=self._prefill.leg_of(request.kind, target) if self._prefill is not None else None,
            max_wait_s=route.fallback_wait_s if route.fallback_after(target) else None)

    def _fallbacks(self, attempt: Attempt, count: int, excluded: set[str]) -> tuple[Pod, ...]:
        """The next best pods after the decision's, for an edge whose data plane retries by itself: by
        the policy's scores when it has scorers, else in the pool's order (the policy's filters kept)."""
        if not count:
            return ()
        decision, routing = attempt.decision, attempt.routing
        if decision.scores:
            names = sorted((n for n in decision.scores if n != decision.pod.name), key=decision.scores.__getitem__,
                           reverse=True)
            pods = [p for n in names[:count] if (p := self._pods.get(n)) is not None]
        else:
            exclude = {decision.pod.name, *excluded, *(n for ns in routing.filtered_out.values() for n in ns)}
            pods = self._pods.candidates(routing.model, frozenset(exclude), routing.leg)[:count]
        return tuple(pods)

    async def _attempt(self, run: _Run, attempt: Attempt, exclude: set[str], route: ModelRoute) -> None:
        """One attempt: dispatched, its adapter registered on its pod where needed, its prefill leg first
        when it is a decode leg, delivered, finished."""
        times = run.times
        for step in self._pipeline.dispatch:
            step.dispatched(attempt)
        outcome: RelayOutcome | None = None
        run.prefill = None
        try:
            if self._adapters is not None and self._adapters.needed(attempt.routing, attempt.decision.pod):
                try:
                    await self._adapters.ready(attempt.routing, attempt.decision.pod)
                except AdapterUnavailable as exc:
                    raise RetryableFailure(upstream_failed(str(exc)), "adapter_load") from None
            if self._prefill is not None and attempt.routing.leg == "decode":
                times.mark(Step.DISPATCH)
                run.prefill = await self._prefill.run(attempt)
                times.mark(Step.PREFILL)
            call = _call(attempt, run.prefill, self._fallbacks(attempt, run.edge.fallbacks, exclude),
                         partial(self._ledger.answering, attempt.dispatch), run.client_left, route)
            delivering = times.mark(Step.DISPATCH)
            outcome = run.outcome = await run.edge.deliver(call)
            headers_at = outcome.headers_at if outcome.headers_at is not None else outcome.first_byte_at
            times.between(Step.CONNECT, delivering, headers_at)
            times.between(Step.FIRST_BYTE, headers_at, outcome.first_byte_at)
        except RetryableFailure as exc:
            times.mark(Step.CONNECT)  # the try that failed before the answer's headers: the next one routes anew
            outcome = RelayOutcome.failed(status_of(exc.error))
            raise
        except GatewayError as err:
            outcome = RelayOutcome.failed(status_of(err))
            raise
        except asyncio.CancelledError:
            outcome = run.outcome or RelayOutcome(499, Ending.CLIENT_GONE)  # mid-stream: what it relayed
            raise
        finally:
            self._ledger.finish(attempt.dispatch)
            ended = outcome or RelayOutcome.failed(500)  # a bug of ours: the edge answers 500
            for step in self._pipeline.finish:
                step.attempt_finished(attempt, ended)


def _call(attempt: Attempt, prefill: PrefillLeg | None, fallbacks: tuple[Pod, ...],
          answering: Callable[[], None], left: Callable[[RelayOutcome], None], route: ModelRoute) -> UpstreamCall:
    request, decision, target = attempt.request, attempt.decision, attempt.routing.model
    answer_headers = {
        "x-request-id": request.id, "x-gateway-pod": decision.pod.name, "x-gateway-policy": decision.policy,
        "x-gateway-prefix-tokens": str(decision.prefix_tokens),
        "x-gateway-cache-action": attempt.plan.header_for(decision), "x-gateway-model": target,
    }
    body = attempt.sent_body
    if prefill is not None and (prefill_pod := prefill.pod) is not None:
        answer_headers["x-gateway-prefill-pod"] = prefill_pod.name
        body = prefill.decode_body or body
    # The answer names what the client asked for, unless the rule shows the target; a split's Responses
    # answer is read for its id (the response that continues it gets the same target).
    restore = target != route.public and not route.expose_target
    capture = route.split and request.kind == RequestKind.RESPONSES
    rewrite = AnswerRewrite(target, route.public if restore else target, capture) if restore or capture else None
    return UpstreamCall(decision.pod, request.path, body, attempt.upstream_headers, answer_headers, request.id,
                        anthropic=request.kind.anthropic, answering=answering, left=left,
                        fallbacks=fallbacks, rewrite=rewrite, tap=request.answer_tap)


def upstream_headers(base: dict[str, str], admitted: Admitted | None, pod: Pod) -> dict[str, str]:
    """One attempt's headers to its pod: the request's, and the priority admission gave it where the pod
    orders its own queue by priority (vLLM reads it from ``X-Vllm-Priority``, before the body's field)."""
    headers = dict(base)
    if admitted is not None and admitted.engine_priority is not None and pod.config.scheduling == "priority":
        headers[ENGINE_PRIORITY_HEADER] = str(admitted.engine_priority)
    return headers


def _fallback(pod: Pod, policy: Policy, routing: RoutingRequest, failed: set[str]) -> Decision:
    """The decision the data plane made for us: one of the EPP's fallback endpoints, after the pods before
    it in the list failed."""
    return Decision(pod=pod, policy=policy.name, reason="fallback", detail=f"after {', '.join(sorted(failed))}",
                    prefix_tokens=routing.prefix_tokens.get(pod.name, 0))


class _Run:
    """The director's own record of one request as it goes: what :class:`CompletedRequest` is built from."""

    __slots__ = ("admitted", "attempts", "body", "edge", "fallbacks", "last", "outcome", "plan", "prefill", "request",
                 "route", "routing", "times")

    def __init__(self, request: ClientRequest, edge: Edge) -> None:
        self.request = request
        self.edge = edge
        self.route: ModelRoute | None = None
        self.body = request.body  # what the attempts send: the client's, its model rewritten for the target
        self.fallbacks: list[tuple[str, str]] = []  # (target, why) of each target that could not serve it
        self.plan: RequestPlan | None = None
        self.routing: RoutingRequest | None = None
        self.admitted: Admitted | None = None
        self.last: Attempt | None = None
        self.outcome: RelayOutcome | None = None
        self.prefill: PrefillLeg | None = None
        self.attempts = 0
        self.times = StepTimes()

    def client_left(self, outcome: RelayOutcome) -> None:
        """The client left mid-stream: how far the answer came is the request's outcome."""
        self.outcome = outcome
