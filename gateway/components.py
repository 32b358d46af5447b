"""One gateway instance as :func:`gateway.app.build_gateway` composes it from its kits (:mod:`gateway.kits`).

The edges that serve clients get only the :class:`~gateway.kits.requests.FrontDoor`; the operators' pages
(``/debug/*``, ``/metrics``) and the processes read the :class:`Gateway`. The server finds it on the aiohttp
application under :data:`GATEWAY_KEY`; nothing else in the package holds global state, so tests build as
many independent gateways as they like.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.backends.health import HealthChecker
from gateway.backends.registry import PodRegistry
from gateway.cluster.bus import StateBus
from gateway.cluster.identity import WorkerIdentity
from gateway.config import GatewayConfig
from gateway.config_reload import ConfigReloader
from gateway.flow.controller import FlowController
from gateway.http_client import HttpClient
from gateway.kits.kit import Kit
from gateway.kits.requests import FrontDoor
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
from gateway.pressure.monitor import PressureMonitor
from gateway.request.context_steps import PlacementLosses
from gateway.request.observers import StepMetrics
from gateway.responses.store import MemoryResponses
from gateway.routing.router import Router
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.keep_warm import KeepWarm


@dataclass(eq=False)
class Gateway:
    """The composed kits (``kits``, which the server starts and stops) and the parts of them that the
    operators' pages, the processes and the tests read. Each field is built by a kit (:mod:`gateway.kits`)."""

    config: GatewayConfig
    front: FrontDoor  # what the client-facing edges use (the directors, auth, the stored responses, ...)
    kits: tuple[Kit, ...]  # as composed; they start in dependency order (gateway.kits.kit.start_order)
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
    modes: PressureModes
    identity: WorkerIdentity  # which worker of which replica this is
    bus: StateBus
    losses: PlacementLosses  # where cache hits were lost (/debug/placement)
    keep_warm: KeepWarm | None  # workflow.keep_warm on
    shared_load: SharedLoadTable | None  # with several workers
    own_responses: MemoryResponses | None  # this worker's, which its siblings may ask for (no Redis)
    pressure: PressureMonitor | None  # pressure.enabled
    reloader: ConfigReloader | None  # the config came from a file
    # The OpenTelemetry tracer provider, with tracing on.
    tracer_provider: Any = None


GATEWAY_KEY = web.AppKey("gateway", Gateway)
