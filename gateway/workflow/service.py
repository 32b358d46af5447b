"""The request path's view of workflows and sessions: plan before routing, record after, learn at finish.

A step of the request pipeline at three points: ``route`` (the cache action and the pin), ``dispatch``
and ``finish``. Owner: nothing of its own beyond the idle-expiry task; state lives in the tracker and the
session map, requests in flight in the ledger, and actions go to the executor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multidict import CIMultiDictProxy

from gateway.api.requests import InferenceRequest
from gateway.background import cancel_and_wait
from gateway.config import WorkflowConfig
from gateway.pressure import PressureModes
from gateway.routing.policy import Decision
from gateway.workflow.actions import CacheActionExecutor
from gateway.workflow.context import WorkflowContext, context_key, context_key_of, parse_workflow_context
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import NOOP, ActionKind, Plan, WorkflowTracker

if TYPE_CHECKING:
    from gateway.request.context import RequestContext


@dataclass(slots=True)
class RequestPlan:
    context: WorkflowContext
    plan: Plan
    pin: str | None = None
    pin_reason: str = ""
    header: str = "none"
    # The session key, when session affinity applies (a request outside any workflow).
    session: str | None = None

    @property
    def ledger_keys(self) -> tuple[str | None, str | None, str | None]:
        """The workflow, stage and session under which the ledger counts the request's attempts."""
        wf, stage = self.plan.workflow, self.plan.stage
        return (wf.id if wf else None, stage.id if wf and stage else None, self.session)


NO_PLAN = RequestPlan(WorkflowContext(), Plan(None, None, NOOP))


class WorkflowService:
    def __init__(self, config: WorkflowConfig, tracker: WorkflowTracker, sessions: SessionAffinity,
                 executor: CacheActionExecutor, modes: PressureModes) -> None:
        self.config = config
        self.tracker = tracker
        self.sessions = sessions
        self.executor = executor
        self._modes = modes
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.config.enabled:
            self._task = asyncio.create_task(self._expire_loop(), name="workflow-expiry")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        await self.executor.stop()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.config.idle_ttl_s / 4))
            self.executor.carry_out(self.tracker.expire_idle())

    # Pipeline steps

    def before_route(self, ctx: RequestContext) -> None:
        """The cache action and pin, and the request's context key for placement (read even with workflow
        actions off)."""
        assert ctx.routing is not None and ctx.parsed is not None
        ctx.workflow = self.plan(ctx.http.headers, ctx.parsed, ctx.base_model, ctx.prompt_tokens)
        wc = ctx.workflow.context
        ctx.routing.context_key = context_key(wc.workflow_id, wc.session_id) if ctx.workflow is not NO_PLAN \
            else context_key_of(ctx.http.headers, ctx.parsed)

    def dispatched(self, ctx: RequestContext) -> None:
        assert ctx.decision is not None
        self.record_dispatch(ctx.workflow, ctx.decision, ctx.base_model)

    def attempt_finished(self, ctx: RequestContext) -> None:
        assert ctx.decision is not None
        self.finished(ctx.workflow, ctx.decision.pod.name, ctx.usage.prompt_tokens if ctx.usage else None)

    # The workflow lifecycle

    def plan(self, headers: CIMultiDictProxy[str], body: InferenceRequest | None, model: str,
             prompt_tokens: int) -> RequestPlan:
        if not self.config.enabled or body is None:
            return NO_PLAN
        ctx = parse_workflow_context(headers, body)
        plan = self.tracker.begin(ctx, model, prompt_tokens)
        session = ctx.session_id if ctx.workflow_id is None and self.config.session_affinity else None
        rp = RequestPlan(ctx, plan, session=session or None)
        action = plan.action
        # In a KV-memory emergency a pod takes no new pinned work.
        if action.kind is ActionKind.PRESERVE and action.pod and not self._modes.in_emergency(action.pod):
            rp.pin, rp.pin_reason = action.pod, "workflow_preserve"
        elif session:
            pod = self.sessions.pod_of(session)
            if pod and not self._modes.in_emergency(pod):
                rp.pin, rp.pin_reason = pod, "session_affinity"
        return rp

    def record_dispatch(self, rp: RequestPlan, decision: Decision, model: str) -> None:
        if rp is NO_PLAN:
            return
        action = rp.plan.action
        if rp.pin and decision.unpinned == rp.pin:
            rp.header = f"{action.kind.value}-fallback:pod_unavailable" if rp.plan.workflow else "session-moved"
        else:
            rp.header = action.header
        if rp.plan.workflow is not None:
            if action.kind is ActionKind.PRESERVE:
                self.executor.record(action)  # flushes are recorded as they are carried out
            actions = self.tracker.dispatched(rp.plan, decision.pod.name, model)
            if action.kind is ActionKind.FLUSH and action not in actions:
                actions.append(action)
            self.executor.carry_out(actions)
        elif rp.session is not None:
            self.sessions.started(rp.session, decision.pod.name)

    def finished(self, rp: RequestPlan, pod: str, prompt_tokens: int | None) -> None:
        if rp is NO_PLAN:
            return
        if rp.plan.workflow is not None:
            self.executor.carry_out(self.tracker.finished(rp.plan, pod, prompt_tokens))
