"""The workflow tracker: workflows, their stages, per-pod cache entries and in-flight requests.

Owner: the :class:`WorkflowTracker` is the only writer of workflow state; the workflow service calls it
as requests start, are dispatched and finish, and the API and the pressure monitor read it. Which of a
workflow's requests are in flight it reads from the in-flight ledger. It decides cache actions
(``docs/architecture.md``, "Workflow cache actions") but carries none out: that is the executor's job.

With several workers or replicas each keeps its own tracker and tells the others each change (the sink it
is built with): a stage that began, where it was dispatched, that it finished, that a workflow completed
or a preserve ended. The others apply the change to their copy (:meth:`WorkflowTracker.apply_remote`) but decide
nothing from it: the process that served the request carries out its actions, so each flush is done once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gateway.config import WorkflowConfig
from gateway.core.facts import (
    PreserveDropped,
    Publish,
    StageBegan,
    StageDispatched,
    StageFinished,
    WorkflowCompleted,
    unshared,
)
from gateway.load.ledger import InFlightLedger
from gateway.workflow.context import WorkflowContext


class ActionKind(enum.StrEnum):
    NOOP = "noop"
    PRESERVE = "preserve"
    FLUSH = "flush"


@dataclass(slots=True)
class CacheAction:
    kind: ActionKind
    reason: str
    workflow_id: str | None = None
    pod: str | None = None  # preserve: where to route; flush: whose cache to let go

    @property
    def header(self) -> str:
        return self.kind.value if self.kind is ActionKind.NOOP else f"{self.kind.value}:{self.reason}"


NOOP = CacheAction(ActionKind.NOOP, "none")


@dataclass(slots=True)
class CacheEntry:
    pod: str
    model: str
    tokens: int
    preserved: bool
    updated: float


@dataclass(slots=True)
class Stage:
    id: str
    model: str
    prompt_tokens: int
    started: float
    pod: str | None = None
    completed: bool = False
    after: str | None = None  # the stage it followed where it began


@dataclass(slots=True)
class Workflow:
    id: str
    started: float
    last_activity: float
    stages: dict[str, Stage] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    entries: dict[str, CacheEntry] = field(default_factory=dict)
    complete_requested: bool = False

    def previous_stage(self, stage_id: str) -> Stage | None:
        index = self.order.index(stage_id) if stage_id in self.order else len(self.order)
        return self.stages[self.order[index - 1]] if index > 0 else None

    def preserved_pod(self) -> str | None:
        preserved = [e for e in self.entries.values() if e.preserved]
        return max(preserved, key=lambda e: e.updated).pod if preserved else None


@dataclass(slots=True)
class Plan:
    """What the tracker decided for one request before routing."""

    workflow: Workflow | None
    stage: Stage | None
    action: CacheAction


class WorkflowTracker:
    def __init__(self, config: WorkflowConfig, ledger: InFlightLedger, publish: Publish = unshared) -> None:
        self.config = config
        self.workflows: dict[str, Workflow] = {}
        self._ledger = ledger
        self._publish = publish

    def in_flight(self, workflow: Workflow) -> int:
        return self._ledger.of_workflow(workflow.id)

    # Request lifecycle

    def begin(self, ctx: WorkflowContext, model: str, prompt_tokens: int, now: float | None = None) -> Plan:
        if not ctx.workflow_id:
            return Plan(None, None, NOOP)
        now = time.monotonic() if now is None else now
        wf = self._touch(ctx.workflow_id, ctx.complete, now)
        stage_id = ctx.stage_id or (wf.order[-1] if wf.order else "default")
        stage = wf.stages.get(stage_id)
        if stage is not None:  # another request of a running stage: keep it where the stage is
            pod = stage.pod or wf.preserved_pod()
            kind = ActionKind.PRESERVE if pod and wf.entries.get(pod, None) and wf.entries[pod].preserved \
                else ActionKind.NOOP
            return Plan(wf, stage, CacheAction(kind, "same_stage", wf.id, pod) if kind is ActionKind.PRESERVE
                        else NOOP)
        after = wf.order[-1] if wf.order else None
        stage = self._new_stage(wf, Stage(stage_id, model, prompt_tokens, now, after=after))
        self._publish(StageBegan(wf.id, stage_id, model, prompt_tokens, ctx.complete, stage.after))
        return Plan(wf, stage, self.decide(ctx, wf, stage))

    def _touch(self, workflow_id: str, complete: bool, now: float) -> Workflow:
        wf = self.workflows.get(workflow_id)
        if wf is None:
            wf = self.workflows[workflow_id] = Workflow(workflow_id, now, now)
        wf.last_activity = now
        wf.complete_requested |= complete
        return wf

    @staticmethod
    def _new_stage(wf: Workflow, stage: Stage) -> Stage:
        """``stage`` in the workflow's order: after the stage it followed, before one known to have followed it
        (another sender's stage can arrive before the one it followed), else last."""
        order = wf.order
        at = next((i for i, s in enumerate(order) if wf.stages[s].after == stage.id), None)
        if at is None and stage.after in wf.stages:
            at = order.index(stage.after) + 1
        wf.stages[stage.id] = stage
        order.insert(len(order) if at is None else at, stage.id)
        return stage

    def decide(self, ctx: WorkflowContext, wf: Workflow, stage: Stage) -> CacheAction:
        """The policy chain at a stage start: override, small increment, boundary, noop."""
        previous = wf.previous_stage(stage.id)
        holder = wf.preserved_pod() or (previous.pod if previous else None)
        if ctx.cache_policy == "preserve":
            return CacheAction(ActionKind.PRESERVE, "override", wf.id, holder) if holder else NOOP
        if ctx.cache_policy == "flush":
            return CacheAction(ActionKind.FLUSH, "override", wf.id, holder) if holder else NOOP
        if previous is None or previous.pod is None:
            return NOOP
        if previous.model != stage.model:
            return CacheAction(ActionKind.FLUSH, "model_changed", wf.id, previous.pod)
        threshold = ctx.preserve_threshold if ctx.preserve_threshold is not None \
            else self.config.preserve_threshold_tokens
        entry = wf.entries.get(previous.pod)
        base = entry.tokens if entry else previous.prompt_tokens
        if stage.prompt_tokens - base <= threshold:
            return CacheAction(ActionKind.PRESERVE, "small_increment", wf.id, previous.pod)
        return NOOP

    def dispatched(self, plan: Plan, pod: str, model: str, now: float | None = None
                   ) -> list[CacheAction]:
        """The request went to ``pod``: record it; a workflow leaving a preserved pod flushes it there."""
        wf, stage = plan.workflow, plan.stage
        if wf is None or stage is None:
            return []
        action = plan.action
        self._publish(StageDispatched(wf.id, stage.id, pod, model, action.kind.value, action.pod))
        return self._dispatched(wf, stage, plan.action, pod, model, time.monotonic() if now is None else now)

    def _dispatched(self, wf: Workflow, stage: Stage, action: CacheAction, pod: str, model: str, now: float
                    ) -> list[CacheAction]:
        stage.pod = pod
        flushes = [CacheAction(ActionKind.FLUSH, "left_pod", wf.id, other)
                   for other, e in wf.entries.items() if e.preserved and other != pod]
        if action.kind is ActionKind.FLUSH and action.pod and action.pod != pod:
            flushes.append(action)
        for flush in flushes:
            wf.entries[flush.pod].preserved = False  # type: ignore[index]
        keep = action.kind is ActionKind.PRESERVE and action.pod == pod
        entry = wf.entries.get(pod)
        wf.entries[pod] = CacheEntry(pod, model, max(stage.prompt_tokens, entry.tokens if entry else 0), keep, now)
        return _dedupe(flushes)

    def finished(self, plan: Plan, pod: str, prompt_tokens: int | None = None,
                 now: float | None = None) -> list[CacheAction]:
        wf, stage = plan.workflow, plan.stage
        if wf is None or stage is None:
            return []
        self._publish(StageFinished(wf.id, stage.id, pod, prompt_tokens))
        self._finished(wf, stage, pod, prompt_tokens, time.monotonic() if now is None else now)
        if wf.complete_requested and not self.in_flight(wf):
            return self.complete(wf.id, "workflow_complete")
        return []

    def _finished(self, wf: Workflow, stage: Stage, pod: str, prompt_tokens: int | None, now: float) -> None:
        wf.last_activity = now
        if prompt_tokens:  # the engine's own count is exact: the next stage's increment is measured from it
            stage.prompt_tokens = prompt_tokens
            if pod in wf.entries:
                wf.entries[pod].tokens = prompt_tokens
        if not self._ledger.of_stage(wf.id, stage.id):
            stage.completed = True

    def complete(self, workflow_id: str, reason: str = "workflow_complete") -> list[CacheAction]:
        wf = self.workflows.get(workflow_id)
        if wf is None:
            return []
        if self.in_flight(wf):
            wf.complete_requested = True  # finishes when its last request does
            return []
        del self.workflows[workflow_id]
        self._publish(WorkflowCompleted(workflow_id))
        return [CacheAction(ActionKind.FLUSH, reason, wf.id, pod) for pod in wf.entries]

    def expire_idle(self, now: float | None = None) -> list[CacheAction]:
        now = time.monotonic() if now is None else now
        idle = [wf.id for wf in self.workflows.values()
                if not self.in_flight(wf) and now - wf.last_activity > self.config.idle_ttl_s]
        return [a for wid in idle for a in self.complete(wid, "idle_expired")]

    # Queries

    def others_on(self, pod: str, workflow_id: str | None) -> bool:
        """Whether a hard flush of ``pod`` would hurt anyone else: a request of another workflow (or of
        none) running there, or another live workflow whose cache is there (between its stages)."""
        return self._ledger.others_on(pod, workflow_id) or any(
            wf.id != workflow_id and pod in wf.entries for wf in self.workflows.values())

    def requests_on(self, pod: str) -> int:
        """Requests in flight on ``pod``, of any workflow or none."""
        return self._ledger.on_pod(pod)

    def idle_preserved(self, pod: str) -> list[Workflow]:
        """Workflows preserving a cache on ``pod`` with nothing in flight, least recently active first."""
        found = [wf for wf in self.workflows.values()
                 if not self.in_flight(wf) and (e := wf.entries.get(pod)) is not None and e.preserved]
        return sorted(found, key=lambda wf: wf.last_activity)

    def soft_flush(self, pod: str, workflow_id: str | None = None) -> None:
        """Stop preserving on ``pod``: one workflow's entry, or (after a hard flush) every workflow's."""
        self._publish(PreserveDropped(pod, workflow_id))
        self._soft_flush(pod, workflow_id)

    def _soft_flush(self, pod: str, workflow_id: str | None) -> None:
        for wf in self.workflows.values():
            if workflow_id is None or wf.id == workflow_id:
                entry = wf.entries.get(pod)
                if entry is not None:
                    entry.preserved = False


    # Changes made by other workers and replicas: state only, no actions (their sender carries them out)

    def apply_remote(self, origin: str, fact: StageBegan | StageDispatched | StageFinished | WorkflowCompleted
              | PreserveDropped) -> None:
        now = time.monotonic()
        match fact:
            case StageBegan():
                wf = self._touch(fact.workflow, fact.complete, now)
                if fact.stage not in wf.stages:
                    self._new_stage(wf, Stage(fact.stage, fact.model, fact.prompt_tokens, now, after=fact.after))
            case StageDispatched():
                if found := self._stage(fact.workflow, fact.stage):
                    wf, stage = found
                    action = CacheAction(ActionKind(fact.action), "remote", wf.id, fact.action_pod)
                    self._dispatched(wf, stage, action, fact.pod, fact.model, now)
            case StageFinished():
                if found := self._stage(fact.workflow, fact.stage):
                    self._finished(*found, fact.pod, fact.prompt_tokens, now)
            case WorkflowCompleted():
                self.workflows.pop(fact.workflow, None)
            case PreserveDropped():
                self._soft_flush(fact.pod, fact.workflow)

    def _stage(self, workflow_id: str, stage_id: str) -> tuple[Workflow, Stage] | None:
        """A stage this tracker knows (a fact about one it missed the start of is ignored)."""
        wf = self.workflows.get(workflow_id)
        stage = wf.stages.get(stage_id) if wf is not None else None
        return (wf, stage) if wf is not None and stage is not None else None


def _dedupe(actions: list[CacheAction]) -> list[CacheAction]:
    seen: set[str | None] = set()
    out = []
    for action in actions:
        if action.pod not in seen:
            seen.add(action.pod)
            out.append(action)
    return out
