"""The :class:`RequestDirector`: runs one client request through the pipeline's extension points.

Owner: the director alone builds the typed views the steps see (:mod:`gateway.request.types`), runs the
retry loop, writes the in-flight ledger (dispatch before an attempt is sent, finish when it ends), and
records how the request ended, once, from the proxy's returned outcome. Everything a feature does
happens in a step (:mod:`gateway.request.pipeline`); the proxy only forwards and relays. For a model
whose pods have roles, each attempt is the decode leg, and its prefill leg is run first by a collaborator
(:mod:`gateway.request.disaggregation`).
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

from aiohttp import web

from gateway.api.errors import REQUEST_ID, status_of
from gateway.auth import ApiKey
from gateway.backends.registry import Pod, PodRegistry
from gateway.core.errors import GatewayError
from gateway.core.requests import InferenceRequest, parse_inference_request
from gateway.load.ledger import InFlightLedger
from gateway.proxy.forward import Proxy
from gateway.proxy.outcome import Ending, RelayOutcome, RetryableFailure, UpstreamCall
from gateway.request.body import read_body
from gateway.request.disaggregation import PrefillLegs
from gateway.request.pipeline import RequestPipeline
from gateway.request.types import (
    ENGINE_PRIORITY_HEADER,
    Admitted,
    Attempt,
    ClientRequest,
    CompletedRequest,
    PrefillLeg,
)
from gateway.routing.policy import Policy, RoutingRequest
from gateway.routing.router import Router
from gateway.workflow.service import NO_PLAN, RequestPlan

log = logging.getLogger("gateway.proxy")

# What the director knows of a body it could not read or parse: nothing.
_UNREAD = InferenceRequest()


class RequestPlanner(Protocol):
    """Plans a request before it is routed: its workflow cache action and the pod it is pinned to."""

    def plan(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> RequestPlan: ...


class NoPlanner:
    """For requests that belong to no workflow (Anthropic's count_tokens)."""

    def plan(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> RequestPlan:
        return NO_PLAN


class RequestDirector:
    def __init__(self, pipeline: RequestPipeline, router: Router, planner: RequestPlanner, ledger: InFlightLedger,
                 proxy: Proxy, pods: PodRegistry, *, max_retries: int, default_consumption: float,
                 allow_strategy_header: bool, max_body_bytes: int, prefill: PrefillLegs | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pipeline = pipeline
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

    async def handle(self, http: web.Request, kind: str, key: ApiKey | None) -> web.StreamResponse:
        request_id = http.headers.get("x-request-id") or f"{self._id_prefix}{next(self._id_counter):x}"
        http[REQUEST_ID] = request_id
        run = _Run(ClientRequest(http, request_id, kind, self._clock(), b"", _UNREAD, key))
        status = 500
        try:
            body = await read_body(http, self._max_body_bytes)
            run.request = ClientRequest(http, request_id, kind, run.request.started, body,
                                        parse_inference_request(body), key)
            response = await self._serve(run)
            status = run.outcome.status if run.outcome is not None else response.status
            return response
        except GatewayError as err:
            status = status_of(err)
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away first
            raise
        finally:
            done = CompletedRequest(run.request, status, self._clock(), run.attempts, run.routing, run.admitted,
                                    run.last, run.outcome, run.prefill)
            for step in self._pipeline.complete:
                step.completed(done)

    async def _serve(self, run: _Run) -> web.StreamResponse:
        request = run.request
        policy, routing = self._resolve(request)
        run.routing = routing
        for prepare in self._pipeline.prepare:
            if (waiting := prepare.prepare(request, policy, routing)) is not None:
                await waiting
        for admit in self._pipeline.admit:
            if (admitting := admit.admit(request, policy, routing)) is not None and (
                    admitted := await admitting) is not None:
                run.admitted = admitted
        plan = self._planner.plan(request, policy, routing)
        headers = self._proxy.upstream_headers(request.headers, request.id)
        exclude: set[str] = set()
        failure: RetryableFailure | None = None
        for number in range(self._max_retries + 1):
            started = self._clock()
            try:
                decision = self._router.route(routing, policy, frozenset(exclude), plan.pin, plan.pin_reason,
                                              binding=plan.pin_binding)
            except GatewayError:
                if failure:  # every pod we could try has failed: say why, not just "none left"
                    raise failure.error from None
                raise
            estimate = routing.estimates.get(decision.pod.name)
            dispatch = self._ledger.dispatch(
                request.id, decision.pod.name, estimate.consumption if estimate else self._default_consumption,
                request.kind, context=routing.context_key, stage=plan.stage_owner,
                prefill_tokens=request.prompt_tokens(routing.token_ids) - decision.prefix_tokens)
            run.last = attempt = Attempt(request, policy, routing, plan, decision, dispatch, number, started,
                                         upstream_headers(headers, run.admitted, decision.pod))
            run.attempts = number + 1
            try:
                return await self._attempt(run, attempt)
            except RetryableFailure as exc:
                failure = exc
                exclude.add(decision.pod.name)
                log.warning("request %s: pod %s failed before the first byte (%s: %s)",
                            request.id, decision.pod.name, exc.cause, exc.error.message)
        assert failure is not None  # the loop runs at least once, and only a failure continues it
        raise failure.error

    def _resolve(self, request: ClientRequest) -> tuple[Policy, RoutingRequest]:
        """The routing policy (the default, or ``x-routing-strategy`` where allowed) and the routing view
        of the request, which the prepare steps fill."""
        override = request.headers.get("x-routing-strategy") if self._allow_strategy_header else None
        base = self._pods.base_model(request.model)
        return self._router.resolve(override), RoutingRequest(
            request.id, request.model, request.kind, request.parsed, base_model=base,
            lora_name=request.model if base != request.model else None,
            leg=self._prefill.leg_of(request.kind, request.model) if self._prefill is not None else None)

    async def _attempt(self, run: _Run, attempt: Attempt) -> web.StreamResponse:
        """One attempt: dispatched, its prefill leg first when it is a decode leg, relayed, finished."""
        for step in self._pipeline.dispatch:
            step.dispatched(attempt)
        outcome: RelayOutcome | None = None
        run.prefill = None
        try:
            if self._prefill is not None and attempt.routing.leg == "decode":
                run.prefill = await self._prefill.run(attempt)
            call = self._call(attempt, run.prefill, partial(self._ledger.answering, attempt.dispatch))
            response, outcome = await self._proxy.forward(call)
            run.outcome = outcome
            return response
        except RetryableFailure as exc:
            outcome = RelayOutcome.failed(status_of(exc.error))
            raise
        except GatewayError as err:
            outcome = RelayOutcome.failed(status_of(err))
            raise
        except asyncio.CancelledError:
            outcome = RelayOutcome(499, Ending.CLIENT_GONE)
            raise
        finally:
            self._ledger.finish(attempt.dispatch)
            ended = outcome or RelayOutcome.failed(500)  # a bug of ours: the middleware answers 500
            for step in self._pipeline.finish:
                step.attempt_finished(attempt, ended)

    @staticmethod
    def _call(attempt: Attempt, prefill: PrefillLeg | None, answering: Callable[[], None]) -> UpstreamCall:
        request, decision = attempt.request, attempt.decision
        answer_headers = {
            "x-request-id": request.id, "x-gateway-pod": decision.pod.name, "x-gateway-policy": decision.policy,
            "x-gateway-prefix-tokens": str(decision.prefix_tokens),
            "x-gateway-cache-action": attempt.plan.header_for(decision),
        }
        body = request.body
        if prefill is not None and (prefill_pod := prefill.pod) is not None:
            answer_headers["x-gateway-prefill-pod"] = prefill_pod.name
            body = prefill.decode_body or body
        return UpstreamCall(decision.pod, request.http, body, attempt.upstream_headers, answer_headers,
                            request.id, anthropic=request.kind in ("messages", "count_tokens"), answering=answering)


def upstream_headers(base: dict[str, str], admitted: Admitted | None, pod: Pod) -> dict[str, str]:
    """One attempt's headers to its pod: the request's, and the priority admission gave it where the pod
    orders its own queue by priority (vLLM reads it from ``X-Vllm-Priority``, before the body's field)."""
    headers = dict(base)
    if admitted is not None and admitted.engine_priority is not None and pod.config.scheduling == "priority":
        headers[ENGINE_PRIORITY_HEADER] = str(admitted.engine_priority)
    return headers


class _Run:
    """The director's own record of one request as it goes: what :class:`CompletedRequest` is built from."""

    __slots__ = ("admitted", "attempts", "last", "outcome", "prefill", "request", "routing")

    def __init__(self, request: ClientRequest) -> None:
        self.request = request
        self.routing: RoutingRequest | None = None
        self.admitted: Admitted | None = None
        self.last: Attempt | None = None
        self.outcome: RelayOutcome | None = None
        self.prefill: PrefillLeg | None = None
        self.attempts = 0
