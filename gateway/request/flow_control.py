"""The flow-control step: which flow a request is, whether it goes now or waits, and what its flow is charged.

- admit: the request's flow (:mod:`gateway.flow.flows`) and SLO (:mod:`gateway.admission`); a request no pod
  can serve within its SLO is refused; one that finds room and nobody waiting goes on at once, else it
  waits in the flow controller (:mod:`gateway.flow.controller`), no longer than its TTFT target allows
  from its arrival (what it waited for a target it fell back from counts). Returns :class:`Admitted`: the
  flow, the SLO, how long it waited, and the priority a pod that schedules by priority is to give it (its
  band, then its flow's service as it leaves: :func:`gateway.flow.flows.engine_priority`). A request
  released after waiting has the pods that had room then written to ``routing.room``: the router keeps to
  them; one that goes on at once is routed among all (the policy weighs load against cached prefixes);
- dispatch: the attempt's expected service is charged to its flow (prompt tokens, those predicted cached at
  a discount, and the predicted output), the flow counts as served until the attempt ends, and the controller
  may release the next request;
- finish: the charge is corrected to what the engine reported serving (its usage), and the tokens counted
  per flow; an attempt that failed before anything was relayed is refunded;
- complete: a request released but never dispatched lets the next one go.

Owner: for each request in flight, its flow and what each of its attempts was charged.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.admission import Slo, SloPolicy
from gateway.core.contexts import workflow_id_of
from gateway.core.errors import ErrorKind, GatewayError
from gateway.flow.controller import FlowController, Held
from gateway.flow.flows import Flow, FlowKey, engine_priority
from gateway.flow.metrics import FlowMetrics
from gateway.flow.saturation import Demand
from gateway.flow.service_counters import WorkflowFlows
from gateway.pods.registry import PodRegistry
from gateway.proxy.outcome import Ending, RelayOutcome
from gateway.request.types import Admitted, Attempt, ClientRequest, CompletedRequest
from gateway.routing.policy import Policy, RoutingRequest


@dataclass(slots=True)
class _Charge:
    """What an attempt was charged at dispatch, in tokens (the counter gets their weighted sum)."""

    prefilled: int
    cached: int
    output: int
    amount: float


@dataclass(eq=False, slots=True)
class _InFlight:
    key: FlowKey
    weight: float
    released: Held | None  # released from waiting and not yet dispatched


class FlowControlStep:
    def __init__(self, controller: FlowController, slo: SloPolicy, workflows: WorkflowFlows,
                 pods: PodRegistry, metrics: FlowMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._controller = controller
        self._clock = clock  # the director's: a request's ``started`` is read on it
        self._slo = slo
        self._workflows = workflows
        self._pods = pods
        self._metrics = metrics
        self._requests: dict[ClientRequest, _InFlight] = {}
        self._charges: dict[Attempt, tuple[FlowKey, _Charge]] = {}

    def admit(self, request: ClientRequest, policy: Policy, routing: RoutingRequest
              ) -> Admitted | Awaitable[Admitted]:
        """Admitted at once when a pod has room and nothing waits (no coroutine is made), else the wait."""
        earlier = self._requests.pop(request, None)
        if earlier is not None and earlier.released is not None:  # released for a target it then left
            self._controller.landed(earlier.released)
        workflow = workflow_id_of(routing.context_key) if routing.context_key else None
        inherited = self._workflows.get(workflow) if workflow is not None else None
        key_name = request.key.config.name if request.key is not None else None
        controller = self._controller
        flow = controller.policy.resolve(request.headers, key_name, inherited,
                                         request.key.config.tenant if request.key is not None else None)
        headers = request.headers
        slo = self._slo.slo_for(routing.base_model, headers.get("x-slo-ttft-ms"), headers.get("x-slo-e2e-ms"),
                                flow.ttft_s)
        key = controller.queues.key_of(flow.key)
        pods = self._pods.candidates(routing.model, leg=routing.leg)
        try:
            self._slo.check(pods, routing.estimates, slo)
        except GatewayError:
            self._metrics.outcome(key, "slo_unreachable")
            raise
        if workflow is not None:
            self._workflows.began(workflow, flow.key)
        demand = Demand(request.kind, request.prompt_tokens(routing), routing.estimates)
        if not controller.goes_now(pods, demand):
            allowed = self._slo.wait_allowed(pods, routing.estimates, slo)
            if allowed is not None:  # its TTFT runs from its arrival: the waits at targets it fell back from count
                allowed = max(0.0, allowed - (self._clock() - request.started))
            wait_s = flow.max_wait_s if allowed is None else min(allowed, flow.max_wait_s)
            detector = controller.detector
            if routing.max_wait_s is not None and all(detector.saturated_by(p.name, demand) for p in pods):
                # Every pod of this target is saturated: its model rule's fallback takes the request after
                # that long (a target with room waits its turn behind others as any request does).
                if routing.max_wait_s <= 0:
                    self._metrics.outcome(key, "target_saturated")
                    raise GatewayError(ErrorKind.RATE_LIMITED, f"Every pod of `{routing.model}` is saturated.",
                                       code="target_saturated", retry_after_s=1)
                wait_s = min(wait_s, routing.max_wait_s)
            return self._held(request, routing, demand, flow, key, slo, wait_s)
        # Going on at once, it is routed among every pod: the policy weighs a busy pod's cached prefix
        # against its queue itself (kept to the pods with room, shared-prefix bursts lost 0.024 hit ratio).
        self._metrics.outcome(key, "at_once")
        self._requests[request] = _InFlight(key, flow.weight, None)
        return Admitted(slo, 0.0, key, flow.objective, self._engine_priority(key))

    async def _held(self, request: ClientRequest, routing: RoutingRequest, demand: Demand, flow: Flow, key: FlowKey,
                    slo: Slo | None, wait_s: float) -> Admitted:
        release = await self._controller.hold(flow, routing.model, routing.leg, demand, wait_s)
        routing.room = release.room
        self._requests[request] = _InFlight(key, flow.weight, release.held)
        return Admitted(slo, release.waited_s, key, flow.objective, self._engine_priority(key))

    def _engine_priority(self, key: FlowKey) -> int:
        """Its band and its flow's service as it leaves: the least-served flow's requests go first on a pod that
        orders its waiting requests by priority."""
        controller = self._controller
        return engine_priority(key.priority, controller.counters.tag(key, controller.config.lift_credit))

    def dispatched(self, attempt: Attempt) -> None:
        state = self._requests.get(attempt.request)
        if state is None:
            return
        routing, decision = attempt.routing, attempt.decision
        prompt = attempt.request.prompt_tokens(routing)
        cached = min(prompt, decision.prefix_tokens)
        charge = self._charge(prompt - cached, cached, routing.predicted_output_tokens, state.weight)
        self._charges[attempt] = state.key, charge
        self._controller.counters.charge(state.key, charge.amount)
        self._controller.counters.answering(state.key)
        self._controller.queues.dispatched()
        if state.released is not None:
            held, state.released = state.released, None
            self._controller.landed(held)

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        dispatched = self._charges.pop(attempt, None)
        if dispatched is None:
            return
        key, charged = dispatched
        self._controller.counters.answered(key)
        state = self._requests.get(attempt.request)
        if state is None:
            return
        usage = outcome.usage
        if usage is not None:
            reported = usage.cached_tokens
            cached = min(usage.prompt_tokens, reported if reported is not None else charged.cached)
            served = self._charge(usage.prompt_tokens - cached, cached, usage.completion_tokens, state.weight)
        elif outcome.ending is Ending.FAILED:
            served = _Charge(0, 0, 0, 0.0)  # nothing relayed: the pod served nothing we can count
        else:  # no usage asked for: the prompt as predicted, about one token an event (less role and [DONE])
            served = self._charge(charged.prefilled, charged.cached, max(0, outcome.streamed_events - 2), state.weight)
        self._controller.counters.charge(state.key, served.amount - charged.amount)
        self._metrics.served(state.key, served.prefilled, served.cached, served.output)

    def completed(self, done: CompletedRequest) -> None:
        state = self._requests.pop(done.request, None)
        if state is not None and state.released is not None:
            self._controller.landed(state.released)  # released, then refused or gone before any dispatch

    def _charge(self, prefilled: int, cached: int, output: int, weight: float) -> _Charge:
        tokens = self._controller.config.tokens
        amount = (prefilled * tokens.input + cached * tokens.cached_input + output * tokens.output) / weight
        return _Charge(prefilled, cached, output, amount)
