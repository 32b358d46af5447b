"""Every component of one gateway instance, as :func:`gateway.app.build_gateway` wires them.

Routes and the server find them on the aiohttp application under :data:`GATEWAY_KEY`; nothing else in
the package holds global state, so tests build as many independent gateways as they like.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.auth import ApiKeyAuth
from gateway.backends.discovery import PodSetApplier
from gateway.backends.health import HealthChecker
from gateway.backends.registry import PodRegistry
from gateway.backends.scraper import MetricsScraper
from gateway.background import LoopLagProbe
from gateway.cluster.bus import StateBus
from gateway.cluster.identity import WorkerIdentity
from gateway.config import GatewayConfig
from gateway.config_reload import ConfigReloader
from gateway.fleet import PodMembership
from gateway.flow.controller import FlowController
from gateway.http_client import HttpClient
from gateway.kv.service import KvEventService
from gateway.kv.verification import PredictionVerifier
from gateway.kv.working_set import ResumableWorkingSet
from gateway.limits.enforcer import KeyLimits
from gateway.limits.usage import UsageTally
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.pressure_modes import PressureModes
from gateway.load.profiles import ProfileStore
from gateway.load.shared_table import SharedLoadTable
from gateway.metrics import GatewayMetrics
from gateway.models.adapters import AdapterLoader
from gateway.models.rules import ModelRules
from gateway.plugin_registry import PluginRegistry
from gateway.pressure import PressureMonitor
from gateway.proxy.forward import Proxy
from gateway.request.director import RequestDirector
from gateway.request.observers import StepMetrics
from gateway.request.placement import PlacementLosses
from gateway.request.responses import ResponsesState
from gateway.responses.store import MemoryResponses
from gateway.routing.router import Router
from gateway.tokenization.service import TokenizationService
from gateway.workflow.keep_warm import KeepWarm
from gateway.workflow.service import WorkflowService


@dataclass(eq=False)
class Gateway:
    config: GatewayConfig
    http: HttpClient
    pods: PodRegistry
    metrics: GatewayMetrics
    ledger: InFlightLedger
    router: Router
    proxy: Proxy  # the HTTP edge's upstream side
    director: RequestDirector
    counting: RequestDirector  # for count_tokens: routed and relayed, nothing else
    steps: StepMetrics  # the time of each step of the director's requests (/debug/steps)
    models: ModelRules  # public model names and their targets
    adapters: AdapterLoader  # LoRA adapters registered where needed (/debug/adapters)
    limits: KeyLimits  # token and concurrency limits per key and tenant (/debug/usage)
    usage: UsageTally  # requests and tokens per key, tenant and model (/debug/usage)
    auth: ApiKeyAuth
    policies: PluginRegistry
    kv: KvEventService
    tokens: TokenizationService
    profiles: ProfileStore
    load: PendingLoad
    flow: FlowController  # flow control's held requests (SLO admission's too)
    workflows: WorkflowService
    working_set: ResumableWorkingSet
    capacity_of: Callable[[str], float | None]
    health: HealthChecker
    verifier: PredictionVerifier
    membership: PodMembership
    modes: PressureModes
    identity: WorkerIdentity  # which worker of which replica this is
    bus: StateBus
    losses: PlacementLosses  # where cache hits were lost (/debug/placement)
    keep_warm: KeepWarm | None  # workflow.keep_warm on
    shared_load: SharedLoadTable | None  # with several workers
    loop_lag: LoopLagProbe
    responses: ResponsesState  # the Responses API's stored responses
    own_responses: MemoryResponses | None  # this worker's, which its siblings may ask for (no Redis)
    # Present only when their config turns them on.
    pressure: PressureMonitor | None
    scraper: MetricsScraper | None
    discovery: PodSetApplier | None
    reloader: ConfigReloader | None  # the config came from a file
    # The OpenTelemetry tracer provider, with tracing on.
    tracer_provider: Any = None
    # The one field that changes after start: set when shutdown begins (``/readyz`` answers 503).
    draining: bool = False


GATEWAY_KEY = web.AppKey("gateway", Gateway)
