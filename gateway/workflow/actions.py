"""Carrying out cache actions: soft flush always, hard flush through the pod's cache controller when no
other workflow has a request in flight there (nor a cache between its stages: engines flush the whole
pod), refused flushes retried with backoff. A hard flush empties the pod for everyone, so with API keys on
only the admin key's workflows get one (``may_flush_pod``); another key's flush is soft: it lets go of its
own workflow's blocks only.

Owner: the :class:`CacheActionExecutor` owns the pending hard flushes (one task per pod at most). The KV
index learns a hard flush's result from the pod's ``AllBlocksCleared`` event, not from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Literal, Protocol

import aiohttp

from gateway.background import cancel_and_wait
from gateway.core.contexts import workflow_key
from gateway.http_client import HttpClient
from gateway.kv.working_set import ResumableWorkingSet
from gateway.pods.registry import Pod, PodRegistry
from gateway.workflow.metrics import WorkflowMetrics
from gateway.workflow.tracker import ActionKind, CacheAction, WorkflowTracker

log = logging.getLogger("gateway.workflow")

# A hard flush waiting for the pod to be free looks again at least this often.
FLUSH_WAIT_POLL_MAX_S = 2.0

FlushOutcome = Literal["done", "refused", "failed"]


class CacheController(Protocol):
    """Frees a pod's whole prefix cache (engines offer nothing finer)."""

    name: str

    async def flush(self, session: aiohttp.ClientSession, pod: Pod) -> tuple[FlushOutcome, str]: ...


@dataclass(eq=False)
class CacheActionExecutor:
    """Carries out the workflow tracker's cache actions: records each, releases a flushed workflow's blocks and,
    where allowed, empties the pod's cache (``hard_flush``, or the client's own flush; by the workflow's owner:
    ``may_flush_pod``, the admin key's with keys on), retrying a pod that refuses while requests run."""

    tracker: WorkflowTracker
    working_set: ResumableWorkingSet
    pods: PodRegistry
    metrics: WorkflowMetrics
    controller_for: Callable[[Pod], CacheController | None]
    http: HttpClient
    _: KW_ONLY
    hard_flush: bool = False
    may_flush_pod: Callable[[str | None], bool] = lambda workflow: True
    retries: int = 5
    retry_base_s: float = 0.5
    hard_flushes: dict[str, int] = field(default_factory=dict, init=False)  # pod: hard flushes done
    _pending: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)

    def record(self, action: CacheAction) -> None:
        self.metrics.cache_actions.labels(action.kind.value, action.reason, action.pod or "-").inc()

    def carry_out(self, actions: list[CacheAction]) -> None:
        for action in actions:
            self.record(action)
            if action.kind is ActionKind.FLUSH and action.pod:
                self.tracker.soft_flush(action.pod, action.workflow_id)
                self._release(action)
                self._maybe_hard_flush(action)

    def _release(self, action: CacheAction) -> None:
        """A soft flush: the workflow's blocks stop counting as resumable on that pod, so placement may
        let the pod's LRU evict them."""
        if action.workflow_id is None:
            return
        key = workflow_key(action.workflow_id)
        context = self.working_set.context(key)
        if context is None or context.pod != action.pod:
            return
        if context.retained(time.monotonic()) and action.reason != "override":
            # Its client declared it will reuse the prompt: it stays resumable until that lapses.
            log.debug("workflow %s declared a retention: not released on %s", action.workflow_id, action.reason)
            return
        self.working_set.release(key, completed=action.reason == "workflow_complete")

    def _maybe_hard_flush(self, action: CacheAction) -> None:
        pod = self.pods.get(action.pod or "")
        asked = action.reason == "override"  # the client's own x-stage-cache-policy: flush
        if not (self.hard_flush or asked) or pod is None or self.controller_for(pod) is None:
            return
        if not self.may_flush_pod(action.workflow_id):  # the soft flush (its own blocks) stands
            self.metrics.cache_actions.labels("hard_flush_not_allowed", action.reason, pod.name).inc()
            return
        if pod.name not in self._pending or self._pending[pod.name].done():
            self._pending[pod.name] = asyncio.create_task(self._hard(pod, action), name=f"flush-{pod.name}")

    async def _hard(self, pod: Pod, action: CacheAction) -> None:
        controller = self.controller_for(pod)
        assert controller is not None
        delay, wait = self.retry_base_s, self.retry_base_s
        attempt = 0
        while attempt <= self.retries:
            if (waiting_for := self._flush_waits_for(pod, action)) is not None:
                # Not a try: the flush waits as long as another workflow uses the pod (on a slow machine its
                # stage outlasted the tries' backoff, and the flush was dropped without being sent).
                self.metrics.cache_actions.labels("hard_flush_deferred", waiting_for, pod.name).inc()
                await asyncio.sleep(wait)
                wait = min(wait * 2, FLUSH_WAIT_POLL_MAX_S)
                continue
            attempt += 1
            outcome, detail = await controller.flush(self.http.session, pod)
            self.metrics.cache_actions.labels(f"hard_flush_{outcome}", action.reason, pod.name).inc()
            if outcome == "done":
                self.hard_flushes[pod.name] = self.hard_flushes.get(pod.name, 0) + 1
                self.tracker.soft_flush(pod.name)  # the whole pod's cache is gone, every workflow's
                return
            if outcome == "failed":
                log.warning("hard flush of %s failed (%s); the soft flush stands", pod.name, detail)
                return
            log.info("pod %s refused a flush (%s); retry %d in %.1f s", pod.name, detail, attempt, delay)
            await asyncio.sleep(delay)
            delay *= 2
        log.warning("pod %s kept refusing to flush; giving up after %d tries", pod.name, self.retries + 1)

    def _flush_waits_for(self, pod: Pod, action: CacheAction) -> str | None:
        """Why a hard flush of ``pod`` must wait, if it must. The flush is global to the pod: it waits until no
        other workflow runs or keeps a cache there. It also waits for the workflow's own requests there (the
        stage that asked for it, typically): the engine refuses a flush while requests run, and one sent
        before such a request reached the engine would be undone by it. Nor does it empty the cache of a
        workflow whose client declared a retention still running, unless that client asked for the flush."""
        now = time.monotonic()
        key = workflow_key(action.workflow_id or "")
        if self.tracker.others_on(pod.name, action.workflow_id) or self.working_set.others_on(pod.name, key, now):
            return "others_on_pod"
        own = self.working_set.context(key)
        if action.reason != "override" and own is not None and own.pod == pod.name and own.retained(now):
            return "declared_retention"
        if self.tracker.requests_on(pod.name):
            return "own_requests_running"
        return None

    async def stop(self) -> None:
        for task in self._pending.values():
            await cancel_and_wait(task)
