"""Active health checks: ``GET /health`` per pod, with failure and success thresholds, within a budget of
checks per second (a large fleet is checked in turn: :mod:`gateway.pods.rotation`).

Owner: the :class:`HealthChecker` writes ``Pod.healthy`` and, for pods without configured models, the
pod's model list from ``GET /v1/models`` (refreshed while the pod is healthy, so adapters loaded later
appear).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import NamedTuple

import aiohttp

from gateway.background import cancel_and_wait, own_stall
from gateway.config import HealthConfig
from gateway.http_client import HttpClient
from gateway.pods.registry import Pod, PodRegistry
from gateway.pods.rotation import Rotation

log = logging.getLogger("gateway.health")

MODEL_REFRESH_EVERY = 5  # successful checks of a pod
# A pod that did not answer the start's check is asked again after this, then twice as long each time.
FIRST_ANSWER_RETRY_S = 0.1


class HealthChecker:
    def __init__(
        self,
        registry: PodRegistry,
        http: HttpClient,
        config: HealthConfig,
        on_change: Callable[[Pod], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        share: float = 1.0,
        loop_stalled: Callable[[float], float] = lambda since: 0.0,
    ) -> None:
        """``share``: this process's part of the host's checks (one of its workers'). ``loop_stalled``: how
        long the event loop stood still since a ``time.perf_counter()`` reading (``LoopLagProbe``)."""
        self._registry = registry
        self._loop_stalled = loop_stalled
        self._clock = clock
        self._http = http
        self._config = config
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self._first_task: asyncio.Task[None] | None = None
        self._rotation = Rotation(config.max_checks_per_s * share)
        self._first_rotation = Rotation(config.max_checks_per_s * share)
        # Pods that have not answered since the gateway started: their first answer makes them healthy at
        # once, as at start (``success_threshold`` guards against a pod that flaps, which these have not).
        self._unanswered: set[str] = set()

    async def start(self) -> None:
        """Check every pod once (setting health directly from that result), then keep checking; a pod that
        did not answer (still starting, as the simulated pods started beside the gateway are) is asked
        again soon, then less and less often, until the usual interval."""
        await self.check_all(initial=True)
        self._unanswered = {p.name for p in self._registry.all() if not p.healthy}
        self._task = asyncio.create_task(self._loop(), name="health-checker")
        if self._unanswered:
            self._first_task = asyncio.create_task(self._first_answers(), name="health-first-answers")

    def unanswered(self) -> list[Pod]:
        """The pods that have not answered since the gateway started."""
        return [p for p in self._registry.all() if p.name in self._unanswered]

    async def stop(self) -> None:
        await cancel_and_wait(self._first_task)
        await cancel_and_wait(self._task)

    async def _first_answers(self) -> None:
        delay = FIRST_ANSWER_RETRY_S
        while delay < self._config.interval_s and self._unanswered:
            await asyncio.sleep(delay)
            waiting = self._first_rotation.due(self.unanswered(), delay)
            try:
                await asyncio.gather(*(self.check(p, refresh_models=True) for p in waiting))
            except Exception:  # as in the usual rounds: a bug here must not stop the usual checks
                log.exception("health round failed")
            delay *= 2

    async def _loop(self) -> None:
        while True:
            # Jitter keeps many gateway replicas from probing pods in lockstep.
            await asyncio.sleep(self._config.interval_s * random.uniform(0.9, 1.1))
            try:
                pods = self._rotation.due(self._registry.all(), self._config.interval_s)
                await asyncio.gather(*(self.check(p, refresh_models=self._refresh_due(p)) for p in pods))
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health round failed")

    async def check_all(self, initial: bool = False) -> None:
        """Every pod at once (at start: before the gateway serves)."""
        pods = self._registry.all()
        await asyncio.gather(*(self.check(p, initial, initial or self._refresh_due(p)) for p in pods))

    @staticmethod
    def _refresh_due(pod: Pod) -> bool:
        """Each pod's model list is fetched again every few checks (adapters loaded later appear)."""
        return (pod.consecutive_successes + 1) % MODEL_REFRESH_EVERY == 0

    async def check(self, pod: Pod, initial: bool = False, refresh_models: bool = False) -> None:
        started, began = self._clock(), time.perf_counter()
        answer = await self._probe(pod)
        if answer.ok and (refresh_models or not pod.models) and not pod.config.models:
            answer = await self._fetch_models(pod)
        pod.last_check = self._clock()
        if answer.timed_out and own_stall(self._loop_stalled, began, self._config.timeout_s) is not None:
            # Its timer ran out while this process stood still: the pod's answer may have waited behind it.
            # Neither a pass nor a failure; the next round asks again.
            log.info("health check of pod %s timed out while the event loop stood still; not counted", pod.name)
            return
        self._record(pod, answer.ok, answer.error, initial)
        if answer.ok:
            self._registry.health_passed(pod, started)

    def _record(self, pod: Pod, ok: bool, error: str | None, initial: bool) -> None:
        was = pod.healthy
        if ok:
            pod.consecutive_successes += 1
            pod.consecutive_failures = 0
            first_answer = pod.name in self._unanswered
            self._unanswered.discard(pod.name)
            if initial or first_answer or pod.consecutive_successes >= self._config.success_threshold:
                pod.healthy = True
        else:
            pod.consecutive_failures += 1
            pod.consecutive_successes = 0
            pod.last_error = error
            if initial or pod.consecutive_failures >= self._config.failure_threshold:
                pod.healthy = False
        if was != pod.healthy:
            if pod.healthy:
                log.info("pod %s is healthy", pod.name)
            else:
                log.warning("pod %s is unhealthy: %s", pod.name, error)
            if self._on_change:
                self._on_change(pod)

    async def _probe(self, pod: Pod) -> _Answer:
        try:
            async with self._http.session.get(
                f"{pod.url}/health", timeout=aiohttp.ClientTimeout(total=self._config.timeout_s)
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    return _Answer(True)
                return _Answer(False, f"/health answered {resp.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _Answer(False, f"/health failed: {type(exc).__name__}: {exc}", isinstance(exc, TimeoutError))

    async def _fetch_models(self, pod: Pod) -> _Answer:
        try:
            async with self._http.session.get(
                f"{pod.url}/v1/models", timeout=aiohttp.ClientTimeout(total=self._config.timeout_s)
            ) as resp:
                if resp.status != 200:
                    return _Answer(False, f"/v1/models answered {resp.status}")
                payload = await resp.json(content_type=None)
            cards = payload.get("data") if isinstance(payload, dict) else None
            if not isinstance(cards, list):
                return _Answer(False, "/v1/models returned no data list")
            pod.set_models([c for c in cards if isinstance(c, dict)])
            return _Answer(True)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return _Answer(False, f"/v1/models failed: {type(exc).__name__}: {exc}", isinstance(exc, TimeoutError))


class _Answer(NamedTuple):
    """A pod's answer to one probe: whether it passed, and if not why (and whether its timer ran out)."""

    ok: bool
    error: str | None = None
    timed_out: bool = False
