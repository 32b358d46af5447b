"""The request path's view of workflows and sessions: plan before routing, record after, learn at finish.

The request pipeline calls it as the planner, and at dispatch and finish
(:class:`gateway.request.steps.WorkflowPlanning`). Owner: nothing of its own beyond the idle-expiry task;
state lives in the tracker and the session map, requests in flight in the ledger, and actions go to the
executor.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDictProxy

from gateway.background import cancel_and_wait
from gateway.config import WorkflowConfig
from gateway.core.contexts import owned
from gateway.core.errors import ErrorKind, GatewayError
from gateway.core.inference_api import InferenceRequest
from gateway.load.pressure_modes import PressureModes
from gateway.routing.policy import Decision
from gateway.workflow.actions import CacheActionExecutor
from gateway.workflow.context import ContextSignals, WorkflowContext
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import NOOP, ActionKind, Plan, Workflow, WorkflowTracker


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the workflow service decided for one request before it was routed."""

    context: WorkflowContext
    plan: Plan
    pin: str | None = None
    pin_reason: str = ""
    # False: the pin is the pod holding the context, a hint to a policy that places contexts itself.
    pin_binding: bool = True
    # The session key, when session affinity applies (a request outside any workflow).
    session: str | None = None

    @property
    def stage_owner(self) -> tuple[str, str] | None:
        """The (workflow, stage) under which the ledger counts the request's attempts."""
        wf, stage = self.plan.workflow, self.plan.stage
        return (wf.id, stage.id) if wf is not None and stage is not None else None

    def header_for(self, decision: Decision) -> str:
        """``x-gateway-cache-action`` of an answer routed by ``decision``: the action, or that its pin
        could not be kept ("none": workflow actions are off)."""
        if self is NO_PLAN:
            return "none"
        if self.pin and decision.unpinned == self.pin:
            kind = self.plan.action.kind.value
            return f"{kind}-fallback:{decision.unpinned_by}" if self.plan.workflow else "session-moved"
        return self.plan.action.header


NO_PLAN = RequestPlan(WorkflowContext(), Plan(None, None, NOOP))


class WorkflowService:
    def __init__(self, config: WorkflowConfig, tracker: WorkflowTracker, sessions: SessionAffinity,
                 executor: CacheActionExecutor, modes: PressureModes, signals: ContextSignals) -> None:
        self.config = config
        self.signals = signals
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

    # The workflow lifecycle

    def plan(self, headers: CIMultiDictProxy[str], body: InferenceRequest, model: str,
             prompt_tokens: int, placed_by_policy: bool = False, owner: str = "") -> RequestPlan:
        """The cache action and the pin of a request about to be routed. Where the policy places contexts
        itself (``placed_by_policy``), preserving a small increment is its job: the workflow's pod is then a
        hint; a stage that asks to be preserved (``x-stage-cache-policy``) is pinned whatever the policy.
        ``owner``: the API key's tag, whose workflows and sessions the request names."""
        if not self.config.enabled:
            return NO_PLAN
        ctx = self.signals.parse(headers, body, owner)
        plan = self.tracker.begin(ctx, model, prompt_tokens)
        session = ctx.session_id if ctx.workflow_id is None and self.config.session_affinity else None
        action = plan.action
        # In a KV-memory emergency a pod takes no new pinned work.
        if action.kind is ActionKind.PRESERVE and action.pod and not self._modes.in_emergency(action.pod):
            binding = not placed_by_policy or action.reason == "override"
            return RequestPlan(ctx, plan, action.pod, "workflow_preserve", session=session or None,
                               pin_binding=binding)
        if session and (pod := self.sessions.pod_of(session)) and not self._modes.in_emergency(pod):
            return RequestPlan(ctx, plan, pod, "session_affinity", session=session)
        return RequestPlan(ctx, plan, session=session or None)

    def complete(self, workflow_id: str, owner: str = "") -> dict[str, Any]:
        """``POST /v1/workflows/{id}/complete``: the workflow's last request was sent; once none of its
        requests runs, its contexts are released (now, or when its last request ends). ``owner``: the
        caller's key's tag: another key's workflow of that id is not found."""
        kept = owned(owner, workflow_id)
        self._known(kept, workflow_id)
        actions = self.tracker.complete(kept)
        self.executor.carry_out(actions)
        return {"workflow_id": workflow_id,
                "status": "completed" if kept not in self.tracker.workflows else "completing",
                "actions": [{"action": a.kind.value, "reason": a.reason, "pod": a.pod} for a in actions]}

    def describe(self, workflow_id: str, owner: str = "") -> dict[str, Any]:
        """What the gateway knows of a workflow: its stages, where its cache is, what runs (``owner``: as for
        :meth:`complete`; the operators' page passes the id as kept, and no owner)."""
        workflow = self._known(owned(owner, workflow_id), workflow_id)
        return {
            "workflow_id": workflow_id, "in_flight": self.tracker.in_flight(workflow),
            "idle_s": round(time.monotonic() - workflow.last_activity, 3),
            "complete_requested": workflow.complete_requested,
            "stages": [{"stage_id": s.id, "model": s.model, "pod": s.pod, "prompt_tokens": s.prompt_tokens,
                        "status": "completed" if s.completed else "active"}
                       for s in (workflow.stages[i] for i in workflow.order)],
            "cache": [{"pod": e.pod, "model": e.model, "tokens": e.tokens, "preserved": e.preserved}
                      for e in workflow.entries.values()],
        }

    def _known(self, kept_id: str, workflow_id: str) -> Workflow:
        workflow = self.tracker.workflows.get(kept_id)
        if workflow is None:  # another key's workflow of that id is answered the same: its existence is not told
            raise GatewayError(ErrorKind.NOT_FOUND, f"No workflow `{workflow_id}` is being tracked.",
                               code="workflow_not_found")
        return workflow

    def record_dispatch(self, rp: RequestPlan, decision: Decision, model: str) -> None:
        if rp is NO_PLAN:
            return
        action = rp.plan.action
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
