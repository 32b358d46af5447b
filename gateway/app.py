"""Composes the feature kits (:mod:`gateway.kits`) from a config, and the aiohttp ``Application`` that serves them.

Each kit builds its feature's state and steps from the kits composed before it and serves its own routes; the
kits' running parts start in the order their declared dependencies give (:func:`~gateway.kits.kit.start_order`)
and stop in reverse. Nothing else holds global state: tests build as many independent gateways as they like.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from gateway.api.middleware import openai_errors
from gateway.api.records import RECORDS_KEY, AnswerRecords
from gateway.api.routes import Route, add_routes, name_worker
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.replication import replicate
from gateway.config import ConfigSource, GatewayConfig
from gateway.kits.addons import AddOn, addon_options, build_addons
from gateway.kits.fleet import DISCOVERY_GROUP, FleetKit
from gateway.kits.flow import FlowKit
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.keys import LimitsKit, ResponsesKit
from gateway.kits.kit import Kit, Lifecycle, lifecycles
from gateway.kits.models import ModelsKit, RoutingKit
from gateway.kits.requests import RequestsKit
from gateway.kits.serving import ReloadKit, ServingKit, TracingKit
from gateway.kits.state import KvKit, LoadKit, TokensKit
from gateway.kits.workflows import PRESSURE_GROUP, KeepWarmKit, PressureKit, WorkflowKit
from gateway.plugin_registry import PluginRegistry
from gateway.request.hooks import hook_options
from gateway.routing.profiles import POLICY_GROUP, Profiles


@dataclass(frozen=True, eq=False)
class Assembly:
    """The kits, as :func:`build_gateway` composed them (in this order). The processes start and stop them
    (:meth:`lifecycles`) and serve their routes; tests read a feature's state through its kit."""

    foundation: Foundation
    shared: SharedState
    responses: ResponsesKit
    load: LoadKit
    kv: KvKit
    fleet: FleetKit
    flow: FlowKit
    workflows: WorkflowKit
    models: ModelsKit
    limits: LimitsKit
    routing: RoutingKit
    keep_warm: KeepWarmKit
    pressure: PressureKit
    requests: RequestsKit
    tracing: TracingKit
    tokens: TokensKit
    serving: ServingKit
    addons: tuple[AddOn, ...]  # the config's ``kits:`` (gateway/kits/addons.py)
    reload: ReloadKit

    @property
    def kits(self) -> tuple[Kit, ...]:
        shipped = [getattr(self, each.name) for each in fields(self) if each.name not in ("addons", "reload")]
        return (*shipped, *self.addons, self.reload)

    def lifecycles(self) -> list[Lifecycle]:
        """Every kit's running parts, started in the order their requirements give (stopped in reverse)."""
        return lifecycles(self.kits)

    def routes(self) -> list[Route]:
        return [route for kit in self.kits for route in kit.routes()]


def build_gateway(config: GatewayConfig, tracer_provider: Any = None, identity: WorkerIdentity | None = None,
                  source: ConfigSource | None = None) -> Assembly:
    """Every kit, composed. ``tracer_provider``: an OpenTelemetry provider to trace with (tracing on),
    instead of the OTLP exporter the ``OTEL_*`` variables configure. ``identity``: which worker of
    ``serve --workers N`` this is (none: the only one). ``source``: where ``config`` was read from, to
    reload it (none: it is not reloaded)."""
    base = Foundation(config, identity or WorkerIdentity.single())
    shared = SharedState(config, base)
    responses = ResponsesKit(config, base)
    load = LoadKit(config, base, shared)
    kv = KvKit(config, base, shared, load)
    fleet = FleetKit(config, base, shared, load, kv)
    flow = FlowKit(config, base, shared, load)
    workflows = WorkflowKit(config, base, shared, load, kv)
    models = ModelsKit(config, base, shared, load, flow, workflows)
    limits = LimitsKit(config, base, shared, flow)
    routing = RoutingKit(config, base, shared, load, kv, models)
    keep_warm = KeepWarmKit(config, base, shared, load, kv, flow)
    pressure = PressureKit(config, base, load, kv, workflows)
    replicate(shared.bus, shared.ledger, workflows.tracker, kv.sessions, kv.working_set, kv.index, flow.service,
              flow.workflow_flows, models.rules, models.adapter_use, limits.usage)
    tracing = TracingKit(config, tracer_provider)
    tokens = TokensKit(config, base, shared)
    requests = RequestsKit(config, base, shared, load, kv, tokens, flow, workflows, keep_warm, models, routing,
                           limits, responses, tracing.traced)
    serving = ServingKit(requests, tokens, fleet, flow)
    kits = (base, shared, responses, load, kv, fleet, flow, workflows, models, limits, routing, keep_warm, pressure,
            requests, tracing, tokens, serving)
    addons = build_addons(config, base, kits)
    return Assembly(*kits, addons, ReloadKit(config, source, (*kits, *addons), base))


def effective_plugin_options(config: GatewayConfig) -> dict[str, dict[str, Any]]:
    """The options of every plugin the config names, decoded with their defaults (raises
    :class:`~gateway.plugin_registry.UnknownPlugin` or :class:`~gateway.plugin_registry.PluginOptionsError`
    naming the first bad one). Nothing is built: no device or cluster is touched."""
    rc = config.routing
    policies = PluginRegistry(POLICY_GROUP, "routing policy")
    profiles = Profiles(policies, rc.options, rc.profiles)
    named = sorted({rc.policy, *rc.options, *rc.profiles})
    out: dict[str, dict[str, Any]] = {
        "profiles": {name: profiles.effective(name) for name in named},
        "routing": {name: msgspec.to_builtins(policies.options(name, rc.options.get(name)))
                    for name in named if name not in rc.profiles},
    }
    if config.pressure.enabled:
        pressure = config.pressure
        out["pressure"] = _options(PRESSURE_GROUP, "pressure source", pressure.source, pressure.options)
    out["discovery"] = _options(DISCOVERY_GROUP, "discovery source", config.discovery.source, config.discovery.options)
    return {**out, "hooks": hook_options(config.hooks), "kits": addon_options(config)}


def _options(group: str, kind: str, name: str, raw: dict[str, Any]) -> dict[str, Any]:
    return {name: msgspec.to_builtins(PluginRegistry(group, kind).options(name, raw))}


def build_app(gateway: Assembly) -> web.Application:
    """The HTTP server's application: every kit's routes, the answers recorded, the kits started and stopped
    with it, and the drain at shutdown (before the server waits for the requests in flight)."""
    base = gateway.foundation
    records = AnswerRecords(base.metrics)
    server = base.config.server
    app = web.Application(middlewares=[records.middleware(), openai_errors(server.max_header_bytes)],
                          client_max_size=server.max_body_bytes)
    app[RECORDS_KEY] = records
    add_routes(app, gateway.routes())
    name_worker(app, base.identity)
    app.cleanup_ctx.extend(gateway.lifecycles())
    app.on_shutdown.append(partial(_drain, gateway.serving))
    return app


async def _drain(serving: ServingKit, app: web.Application) -> None:
    serving.drain()
