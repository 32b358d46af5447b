"""The request path's view of workflows and sessions: plan before routing, record after, learn at finish.

Owner: nothing of its own beyond the idle-expiry task; state lives in the tracker and the session map,
actions go to the executor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from multidict import CIMultiDictProxy

from gateway.api.requests import InferenceRequest
from gateway.background import cancel_and_wait
from gateway.config import WorkflowConfig
from gateway.load.pending import PendingLoad
from gateway.routing.policy import Decision
from gateway.workflow.actions import CacheActionExecutor
from gateway.workflow.context import WorkflowContext, parse_workflow_context
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import NOOP, ActionKind, Plan, WorkflowTracker


@dataclass(slots=True)
class RequestPlan:
    context: WorkflowContext
    plan: Plan
    pin: str | None = None
    pin_reason: str = ""
    header: str = "none"


NO_PLAN = RequestPlan(WorkflowContext(), Plan(None, None, NOOP))


class WorkflowService:
    def __init__(self, config: WorkflowConfig, tracker: WorkflowTracker, sessions: SessionAffinity,
                 executor: CacheActionExecutor, load: PendingLoad) -> None:
        self.config = config
        self.tracker = tracker
        self.sessions = sessions
        self.executor = executor
        self._load = load
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

    def plan(self, headers: CIMultiDictProxy[str], body: InferenceRequest, model: str,
             prompt_tokens: int) -> RequestPlan:
        if not self.config.enabled:
            return NO_PLAN
        ctx = parse_workflow_context(headers, body)
        plan = self.tracker.begin(ctx, model, prompt_tokens)
        rp = RequestPlan(ctx, plan)
        action = plan.action
        # In a KV-memory emergency a pod takes no new pinned work.
        if action.kind is ActionKind.PRESERVE and action.pod and action.pod not in self._load.blocked:
            rp.pin, rp.pin_reason = action.pod, "workflow_preserve"
        elif ctx.workflow_id is None and ctx.session_id and self.config.session_affinity:
            pod = self.sessions.pod_of(ctx.session_id)
            if pod and pod not in self._load.blocked:
                rp.pin, rp.pin_reason = pod, "session_affinity"
        return rp

    def dispatched(self, rp: RequestPlan, request_id: str, decision: Decision, model: str,
                   notes: dict[str, object]) -> None:
        if rp is NO_PLAN:
            return
        action = rp.plan.action
        if rp.pin and notes.get("pin_fallback") == rp.pin:
            rp.header = f"{action.kind.value}-fallback:pod_unavailable" if rp.plan.workflow else "session-moved"
        else:
            rp.header = action.header
        if rp.plan.workflow is not None:
            if action.kind is ActionKind.PRESERVE:
                self.executor.record(action)  # flushes are recorded as they are carried out
            actions = self.tracker.dispatched(rp.plan, request_id, decision.pod.name, model)
            if action.kind is ActionKind.FLUSH and action not in actions:
                actions.append(action)
            self.executor.carry_out(actions)
        elif rp.context.session_id and self.config.session_affinity:
            self.sessions.started(rp.context.session_id, decision.pod.name)

    def finished(self, rp: RequestPlan, request_id: str, pod: str, prompt_tokens: int | None) -> None:
        if rp is NO_PLAN:
            return
        if rp.plan.workflow is not None:
            self.executor.carry_out(self.tracker.finished(request_id, pod, rp.plan, prompt_tokens))
        elif rp.context.session_id and self.config.session_affinity:
            self.sessions.finished(rp.context.session_id)
