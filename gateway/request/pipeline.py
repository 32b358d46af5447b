"""The extension points of the request path, and the steps plugged into each.

A request passes through them in this order (:class:`~gateway.request.director.RequestDirector`):

1. **prepare**: data the later stages need, read from the request (validation, token ids, the load
   estimate per pod). A step may refuse the request by raising an :class:`~gateway.api.errors.ApiError`.
2. **admit**: whether the request may start now, later (it waits) or never (it is refused).
3. **route**: steps that run before the router decides (a workflow's pin, its cache action); then the
   policy picks a pod.
4. **dispatch**: the attempt is recorded in the in-flight ledger, then each dispatch step sees it.
5. **relay**: the proxy forwards the request and relays the answer (no steps: bytes pass unchanged).
6. **finish**: the attempt ended, however it ended (the ledger first, then each step); a failed
   attempt may be retried on another pod, from step 3.
7. **complete**: the client's request ended; observers record it (metrics, learning, the access log).

Steps are objects with the method of their extension point; one object may sit at several points
(e.g. workflow planning routes, dispatches and finishes). A ``prepare`` or ``admit`` step returns an
awaitable only when it has something to wait for (tokenizing, queueing): most requests pass most steps
without a coroutine being made.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.request.context import RequestContext


class PrepareStep(Protocol):
    def prepare(self, ctx: RequestContext) -> Awaitable[None] | None: ...


class AdmitStep(Protocol):
    def admit(self, ctx: RequestContext) -> Awaitable[None] | None: ...


class RouteStep(Protocol):
    def before_route(self, ctx: RequestContext) -> None: ...


class DispatchStep(Protocol):
    def dispatched(self, ctx: RequestContext) -> None: ...


class FinishStep(Protocol):
    def attempt_finished(self, ctx: RequestContext) -> None: ...


class CompleteStep(Protocol):
    def completed(self, ctx: RequestContext) -> None: ...


@dataclass(slots=True)
class RequestPipeline:
    prepare: list[PrepareStep] = field(default_factory=list)
    admit: list[AdmitStep] = field(default_factory=list)
    route: list[RouteStep] = field(default_factory=list)
    dispatch: list[DispatchStep] = field(default_factory=list)
    finish: list[FinishStep] = field(default_factory=list)
    complete: list[CompleteStep] = field(default_factory=list)
