"""Every component of one gateway instance, as :func:`gateway.app.build_gateway` wires them.

The edges that serve clients (the HTTP routes of the APIs, and the endpoint picker's ext_proc service)
get only the :class:`FrontDoor`; the operators' pages (``/debug/*``, ``/metrics``) and the process that
starts and stops the components get the whole :class:`Gateway`. The server finds it on the aiohttp
application under :data:`GATEWAY_KEY`; nothing else in the package holds global state, so tests build as
many independent gateways as they like.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.auth import ApiKey, ApiKeyAuth
from gateway.backends.discovery import PodSetApplier
from gateway.backends.health import HealthChecker
from gateway.backends.registry import PodRegistry
from gateway.backends.scraper import MetricsScraper
from gateway.background import LoopLagProbe
from gateway.cluster.bus import StateBus
from gateway.cluster.identity import WorkerIdentity
from gateway.config import GatewayConfig, ServerConfig
from gateway.config_reload import ConfigReloader
from gateway.fleet import PodMembership
from gateway.flow.controller import FlowController
from gateway.http_client import HttpClient
from gateway.kv.subscriptions import KvEventService
from gateway.kv.verification import PredictionVerifier
from gateway.kv.working_set import ResumableWorkingSet
from gateway.limits.enforcer import KeyLimits
from gateway.limits.usage import UsageTally
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.pressure_modes import PressureModes
from gateway.load.shared_table import SharedLoadTable
from gateway.load.slo_profiles import ProfileStore
from gateway.metrics import GatewayMetrics
from gateway.models.adapters import AdapterLoader
from gateway.models.rules import ModelRules
from gateway.pressure.monitor import PressureMonitor
from gateway.proxy.forward import Proxy
from gateway.request.context_steps import PlacementLosses
from gateway.request.director import RequestDirector
from gateway.request.observers import StepMetrics
from gateway.request.responses import ResponsesState
from gateway.responses.store import MemoryResponses
from gateway.routing.router import Router
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.keep_warm import KeepWarm
from gateway.workflow.planning import WorkflowService


@dataclass(eq=False)
class FrontDoor:
    """What the edges that serve clients use: who is asking, the two directors, the upstream side, the
    models a key may list, and whether the gateway still takes requests."""

    auth: ApiKeyAuth
    director: RequestDirector
    counting: RequestDirector  # for count_tokens: routed and relayed, nothing else
    proxy: Proxy  # the HTTP edge's upstream side
    pods: PodRegistry
    models: ModelRules  # public model names and their targets
    responses: ResponsesState  # the Responses API's stored responses
    workflows: WorkflowService  # a workflow's state, and its end as the client declares it
    config: ServerConfig
    # The one field that changes after start: set when shutdown begins (readiness answers 503).
    draining: bool = False

    def model_cards(self, key: ApiKey | None) -> list[dict[str, Any]]:
        """``/v1/models``: the pods' models and the public names (:meth:`ModelRules.cards`) that ``key`` may use."""
        return [c for c in self.models.cards(self.pods.model_cards()) if self.auth.may_use(key, str(c.get("id")))]

    def ready_pods(self) -> int:
        """The pods that can take a request now."""
        now = time.monotonic()
        return sum(1 for p in self.pods.all() if p.available(now))


@dataclass(eq=False)
class Gateway:
    config: GatewayConfig
    front: FrontDoor  # what the client-facing edges use (the directors, auth, the stored responses, ...)
    http: HttpClient
    pods: PodRegistry
    metrics: GatewayMetrics
    ledger: InFlightLedger
    router: Router
    steps: StepMetrics  # the time of each step of the director's requests (/debug/steps)
    adapters: AdapterLoader  # LoRA adapters registered where needed (/debug/adapters)
    limits: KeyLimits  # token and concurrency limits per key and tenant (/debug/usage)
    usage: UsageTally  # requests and tokens per key, tenant and model (/debug/usage)
    kv: KvEventService
    tokens: TokenizationService
    profiles: ProfileStore
    load: PendingLoad
    flow: FlowController  # flow control's held requests (SLO admission's too)
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
    own_responses: MemoryResponses | None  # this worker's, which its siblings may ask for (no Redis)
    # Present only when their config turns them on.
    pressure: PressureMonitor | None
    scraper: MetricsScraper | None
    discovery: PodSetApplier | None
    reloader: ConfigReloader | None  # the config came from a file
    # The OpenTelemetry tracer provider, with tracing on.
    tracer_provider: Any = None


GATEWAY_KEY = web.AppKey("gateway", Gateway)
