"""The extension points of the request path, and the steps plugged into each.

A request passes through them in this order (:class:`~gateway.request.director.RequestDirector`):

0. **resolve** ``(request) -> ClientRequest | None``: what the request stands for, once its body is parsed:
   a step refuses it (validation: a :class:`~gateway.core.errors.GatewayError`), or returns it rewritten (a
   Responses request continuing a stored response becomes the whole conversation), bound to one pod, or with
   a tap that reads its answer as it passes; None leaves it as it is. Its time counts to the request's
   ``parse``.
1. **prepare** ``(request, policy, routing)``: what routing needs, read from the request (token ids, the
   context it continues, the load estimate per pod). A step fills the fields of the routing view it
   owns, or refuses the request by raising a :class:`~gateway.core.errors.GatewayError`.
2. **admit** ``(request, policy, routing) -> Admitted | None``: whether the request may start now, later (it
   waits: an awaitable of the result) or never (it is refused); a step that decides the SLO says so.
3. **plan**, then **route**: the workflow planner returns the request's plan (cache action, pin); the
   router returns the decision. Not extension points: one planner, one router.
4. **dispatch** ``(attempt)``: the attempt is recorded in the in-flight ledger, then each step sees it.
5. **relay**: the proxy forwards the request and returns how the answer ended (no steps: bytes pass
   unchanged). For a disaggregated model the attempt is the decode leg, and the director's collaborator
   runs its prefill leg first (:mod:`gateway.request.disaggregation`).
6. **finish** ``(attempt, outcome)``: the attempt ended, however it ended (the ledger first, then each
   step, with the proxy's outcome); a failure before the first byte may be retried on another pod, from
   **route** (the plan stands).
7. **complete** ``(completed)``: the client's request ended; observers record it (metrics, learning, the
   access log) from the one record the director made of it.

Steps are objects with the method of their extension point; one object may sit at several points. A
``prepare`` or ``admit`` step returns an awaitable only when it has something to wait for (tokenizing,
queueing): most requests pass most steps without a coroutine being made. A ``prepare`` step's time counts to
the request's ``prepare`` step in its timings (:mod:`gateway.request.timings`) unless the step names another
(``timed_as``: validation is ``parse``, tokenization ``tokenize``). No step writes what another
step reads except through the routing view's own fields.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.proxy.outcome import RelayOutcome
from gateway.request.types import Admitted, Attempt, ClientRequest, CompletedRequest
from gateway.routing.policy import Policy, RoutingRequest


class ResolveStep(Protocol):
    def resolve(self, request: ClientRequest) -> ClientRequest | Awaitable[ClientRequest] | None: ...


class PrepareStep(Protocol):
    def prepare(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> Awaitable[None] | None: ...


class AdmitStep(Protocol):
    def admit(
        self, request: ClientRequest, policy: Policy, routing: RoutingRequest
    ) -> Admitted | Awaitable[Admitted | None] | None: ...


class DispatchStep(Protocol):
    def dispatched(self, attempt: Attempt) -> None: ...


class FinishStep(Protocol):
    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None: ...


class CompleteStep(Protocol):
    def completed(self, done: CompletedRequest) -> None: ...


@dataclass(slots=True)
class RequestPipeline:
    resolve: list[ResolveStep] = field(default_factory=list)
    prepare: list[PrepareStep] = field(default_factory=list)
    admit: list[AdmitStep] = field(default_factory=list)
    dispatch: list[DispatchStep] = field(default_factory=list)
    finish: list[FinishStep] = field(default_factory=list)
    complete: list[CompleteStep] = field(default_factory=list)
