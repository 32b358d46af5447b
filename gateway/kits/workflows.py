"""The kits that act on what the pods cache: workflows (stages, sessions, cache actions), keep-warm, and
the pressure monitor that flushes or holds contexts as a pod's memory runs short."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial

from gateway.api import debug
from gateway.api.routes import complete_workflow, workflow_state
from gateway.config import GatewayConfig
from gateway.kits.flow import FlowKit
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.kit import Kit, Route, Running
from gateway.kits.state import KvKit, LoadKit
from gateway.plugin_registry import PluginRegistry
from gateway.pods.registry import Pod
from gateway.pressure.monitor import PressureContext, PressureMonitor, PressureSource, PressureSourceUnavailable
from gateway.request.context_steps import CacheRecency
from gateway.request.steps import WorkflowPlanning
from gateway.workflow.actions import CacheActionExecutor, CacheController
from gateway.workflow.context import ContextSignals
from gateway.workflow.keep_warm import KeepWarm
from gateway.workflow.metrics import WorkflowMetrics
from gateway.workflow.planning import WorkflowService
from gateway.workflow.refresh import Refresher
from gateway.workflow.tracker import WorkflowTracker

CONTROLLER_GROUP = "gateway.cache_controllers"
PRESSURE_GROUP = "gateway.pressure_sources"

log = logging.getLogger("gateway.app")


class WorkflowKit(Kit):
    """A workflow's stages (here and shared), the signals that name a context,
    the cache actions a stage asks for, and the step that plans them (``planning``); a workflow's state and
    end as its client asks (``/v1/workflows/{workflow_id}``), and all of them on ``/debug/workflows``."""

    name = "workflows"
    requires = ("foundation",)  # cache actions go through the HTTP client

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit,
                 kv: KvKit) -> None:
        wc = config.workflow
        self.tracker = WorkflowTracker(wc, shared.ledger, shared.sinks.tracker)
        self.executor = CacheActionExecutor(self.tracker, kv.working_set, base.pods,
                                            base.metrics.owned(WorkflowMetrics), cache_controllers(wc.controller),
                                            base.http, hard_flush=wc.hard_flush,
                                            may_flush_pod=base.auth.may_flush_pod, retries=wc.flush_retries,
                                            retry_base_s=wc.flush_retry_base_s)
        self.signals = ContextSignals(wc.session_headers)
        self.service = WorkflowService(wc, self.tracker, kv.sessions, self.executor, load.modes, self.signals)
        self.planning = WorkflowPlanning(self.service)
        self._auth, self._modes = base.auth, load.modes

    def running(self) -> Iterable[Running]:
        return [Running(self.service.start, self.service.stop)]

    def routes(self) -> Iterable[Route]:
        auth, service = self._auth, self.service
        return [Route("POST", "/v1/workflows/{workflow_id}/complete", partial(complete_workflow, auth, service)),
                Route("GET", "/v1/workflows/{workflow_id}", partial(workflow_state, auth, service)),
                Route("GET", "/debug/workflows", partial(debug.workflows_page, auth, service, self._modes))]


class KeepWarmKit(Kit):
    """Refreshing an idle context before its pod evicts it (``workflow.keep_warm``), and the step that reads
    a context's recency before placement holds it anew (``recency``). Both ``None`` when off. Where contexts
    are placed, what they lost and what keep-warm does are on ``/debug/placement``."""

    name = "keep_warm"
    requires = ("workflows", "flow_control", "fleet")

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit, kv: KvKit,
                 flow: FlowKit) -> None:
        self.keep_warm: KeepWarm | None = None
        self.recency: CacheRecency | None = None
        if kv.queues is not None:
            self.keep_warm = KeepWarm(config.workflow.keep_warm, base.pods, kv.working_set, kv.queues, kv.index,
                                      load.load, shared.ledger, load.capacity_of,
                                      Refresher(base.pods, config.auth, base.http, base.metrics), base.metrics,
                                      client_due=flow.flow.waits_for)
            self.recency = CacheRecency(kv.index, kv.queues, self.keep_warm, kv.working_set)
        self._page = partial(debug.placement_page, base.auth, base.pods, kv.working_set, load.capacity_of, kv.losses,
                             self.keep_warm)

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/debug/placement", self._page)]

    def running(self) -> Iterable[Running]:
        return [Running(self.keep_warm.start, self.keep_warm.stop)] if self.keep_warm is not None else []


class PressureKit(Kit):
    """Each pod's memory pressure, read from a source plugin, and what the gateway does about it
    (``pressure.enabled``; ``monitor`` is ``None`` when off)."""

    name = "pressure"
    requires = ("workflows", "fleet")

    def __init__(self, config: GatewayConfig, base: Foundation, load: LoadKit, kv: KvKit,
                 workflows: WorkflowKit) -> None:
        self.monitor: PressureMonitor | None = None
        if config.pressure.enabled:
            readings = pressure_source(config, PressureContext(load.load, kv.working_set, load.capacity_of))
            self.monitor = PressureMonitor(config.pressure, base.pods, readings, workflows.tracker,
                                           kv.working_set, workflows.executor, load.modes, base.metrics)

    def running(self) -> Iterable[Running]:
        return [Running(self.monitor.start, self.monitor.stop)] if self.monitor is not None else []


def cache_controllers(choice: str) -> Callable[[Pod], CacheController | None]:
    """Per pod, the controller named by config, or (``auto``) the one matching the pod's engine."""
    plugins = PluginRegistry(CONTROLLER_GROUP, "cache controller")
    if choice != "auto":
        plugins.load(choice)  # fail at start on an unknown name
    built: dict[str, CacheController | None] = {}

    def controller_for(pod: Pod) -> CacheController | None:
        name = pod.config.flavor if choice == "auto" else choice
        if name not in built:
            built[name] = plugins.build(name, None)
        return built[name]

    return controller_for


def pressure_source(config: GatewayConfig, context: PressureContext) -> PressureSource:
    plugins = PluginRegistry(PRESSURE_GROUP, "pressure source")
    try:
        return plugins.build(config.pressure.source, context, config.pressure.options)
    except PressureSourceUnavailable as exc:
        log.warning("pressure source %s is unavailable here (%s); using engine metrics", config.pressure.source, exc)
        return plugins.build("engine_metrics", context)
