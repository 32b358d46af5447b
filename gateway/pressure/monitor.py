"""KV-memory pressure per pod: five modes with hysteresis, and what each mode makes the gateway do.

Owner: the :class:`PressureMonitor` alone writes each pod's mode, in its :class:`PressureModes`, which
pending load, workflow planning and ``/debug/workflows`` read. Above ``pressure`` it lets go of the context
that has been idle longest on that pod (a workflow's through a soft flush; never one with a request in
flight), one per tick, until the mode falls back: its blocks stop counting as resumable, so placement
may let the pod's LRU evict them; in ``emergency`` it stops new work from being pinned there and tells
admission the pod is full (:meth:`PressureModes.in_emergency`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from gateway.background import cancel_and_wait
from gateway.config import PressureConfig
from gateway.core.contexts import workflow_id_of
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.pending import PendingLoad
from gateway.load.pressure_modes import PressureMode, PressureModes
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import Pod, PodRegistry
from gateway.workflow.actions import CacheActionExecutor
from gateway.workflow.tracker import ActionKind, CacheAction, WorkflowTracker

log = logging.getLogger("gateway.pressure")


class PressureSourceUnavailable(RuntimeError):
    """The source cannot run here (library or device missing); the monitor falls back to engine metrics."""


class PressureSource(Protocol):
    name: str

    def usage(self, pod: Pod) -> float | None: ...


@dataclass(slots=True)
class PressureContext:
    """What a pressure-source plugin may use when it is built."""

    load: PendingLoad
    working_set: ResumableWorkingSet
    capacity_of: Callable[[str], float | None]


class DeviceOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Options of the sources that read a GPU per pod (``nvml``, ``rocm_smi``)."""

    devices: dict[str, int] = {}  # pod name → GPU index


def next_mode(current: PressureMode, usage: float, thresholds: list[float], hysteresis: float) -> PressureMode:
    """Up as soon as a threshold is reached; down only once usage is ``hysteresis`` below it."""
    target = sum(1 for t in thresholds if usage >= t)
    if target >= current:
        return PressureMode(target)
    mode = int(current)
    while mode > target and usage < thresholds[mode - 1] - hysteresis:
        mode -= 1
    return PressureMode(mode)


class PressureMonitor:
    def __init__(self, config: PressureConfig, pods: PodRegistry, source: PressureSource, tracker: WorkflowTracker,
                 working_set: ResumableWorkingSet, executor: CacheActionExecutor, modes: PressureModes,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.source = source
        self._pods = pods
        self._tracker = tracker
        self._working_set = working_set
        self._executor = executor
        self._metrics = metrics
        self.modes = modes
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pressure-monitor")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.tick()
            except Exception:  # a bug here must not end pressure handling for good
                log.exception("pressure tick failed")

    def tick(self) -> None:
        thresholds = [self.config.normal, self.config.pressure, self.config.critical, self.config.emergency]
        for pod in self._pods.all():
            usage = self.source.usage(pod)
            if usage is None:
                continue
            before = self.modes.mode(pod.name)
            mode = next_mode(before, usage, thresholds, self.config.hysteresis)
            self.modes.set(pod.name, mode)
            self._metrics.pressure_mode.labels(pod.name).set(int(mode))
            if mode != before:
                log.info("pod %s: KV pressure %s -> %s (usage %.2f)", pod.name, before.name, mode.name, usage)
            if mode >= PressureMode.PRESSURE:
                self._relieve(pod)

    def _relieve(self, pod: Pod) -> None:
        """Let go of the workflow preserved idle longest on the pod, else the context idle longest."""
        preserved = self._tracker.idle_preserved(pod.name)
        idle = self._working_set.idle_on(pod.name)
        if preserved:
            workflow: str | None = preserved[0].id
        elif idle:
            workflow = workflow_id_of(idle[0].key)
        else:
            return
        if workflow is not None:
            self._executor.carry_out([CacheAction(ActionKind.FLUSH, "pressure", workflow, pod.name)])
        else:
            self._working_set.release(idle[0].key)
