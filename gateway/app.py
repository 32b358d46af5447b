"""Builds the gateway's aiohttp ``Application`` from a config: composes the feature kits (:mod:`gateway.kits`).

Each kit builds its feature's state and steps from the kits composed before it; the kits' running parts
start in the order their declared dependencies give (:func:`~gateway.kits.kit.start_order`, aiohttp's
``cleanup_ctx``) and stop in reverse, each one stopped even if another fails to stop. Nothing else in the
package holds global state; tests build as many independent apps as they like.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from gateway.api.middleware import openai_errors
from gateway.api.records import RECORDS_KEY, AnswerRecords
from gateway.api.routes import add_routes
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.replication import replicate
from gateway.components import GATEWAY_KEY, Gateway
from gateway.config import ConfigSource, GatewayConfig
from gateway.config_reload import ConfigReloader, ReloadMetrics
from gateway.kits.fleet import DISCOVERY_GROUP, FleetKit
from gateway.kits.flow import FlowKit
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.keys import LimitsKit, ResponsesKit
from gateway.kits.kit import Apply, Kit, Running, lifecycles
from gateway.kits.models import ModelsKit, RoutingKit
from gateway.kits.requests import RequestsKit
from gateway.kits.state import KvKit, LoadKit, TokensKit
from gateway.kits.workflows import PRESSURE_GROUP, KeepWarmKit, PressureKit, WorkflowKit
from gateway.plugin_registry import PluginRegistry
from gateway.request.hooks import hook_options
from gateway.request.pipeline import RequestPipeline
from gateway.routing.profiles import POLICY_GROUP, Profiles


def build_gateway(config: GatewayConfig, tracer_provider: Any = None, identity: WorkerIdentity | None = None,
                  source: ConfigSource | None = None) -> Gateway:
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
    kits: list[Kit] = [base, shared, responses, load, kv, fleet, flow, workflows, models, limits, routing, keep_warm,
                       pressure, requests, tracing, tokens]
    reload = ReloadKit(config, source, kits, base)
    return Gateway(
        config=config, front=requests.front, kits=(*kits, reload), http=base.http, pods=base.pods,
        metrics=base.metrics, ledger=shared.ledger, router=routing.router, steps=requests.steps,
        adapters=models.adapters, limits=limits.limits, usage=limits.tally, kv=kv.events, tokens=tokens.tokens,
        profiles=load.profiles, load=load.load, flow=flow.flow, working_set=kv.working_set,
        capacity_of=load.capacity_of, health=fleet.health, verifier=kv.verifier, modes=load.modes,
        identity=base.identity, bus=shared.bus, losses=kv.losses, keep_warm=keep_warm.keep_warm,
        shared_load=shared.shared_load, pressure=pressure.monitor, reloader=reload.reloader,
        own_responses=responses.own, tracer_provider=tracing.provider,
    )


class TracingKit(Kit):
    """OpenTelemetry spans of each request (``tracing.enabled``): the pipeline traced, and the spans still
    batched flushed at stop."""

    name = "tracing"

    def __init__(self, config: GatewayConfig, tracer_provider: Any) -> None:
        self.provider: Any = None
        if config.tracing.enabled:
            from gateway.request import tracing  # the otel extra: imported only when tracing is on

            self.provider = tracer_provider or tracing.tracer_provider()
            self._tracer = self.provider.get_tracer(tracing.INSTRUMENTATION)
            self._traced = tracing.traced

    def traced(self, pipeline: RequestPipeline) -> RequestPipeline:
        return self._traced(pipeline, self._tracer) if self.provider is not None else pipeline

    def running(self) -> Iterable[Running]:
        provider = self.provider
        return [Running(lambda: None, lambda: asyncio.to_thread(provider.shutdown))] if provider is not None else []


class ReloadKit(Kit):
    """The config file read again when it changes or on SIGHUP (``reloader``: ``None`` when the config came
    from no file), each live section handed to the kit that reloads it."""

    name = "reload"

    def __init__(self, config: GatewayConfig, source: ConfigSource | None, kits: Sequence[Kit],
                 base: Foundation) -> None:
        self.reloader: ConfigReloader | None = None
        if source is None or not source.path:
            return
        self.requires = tuple(kit.name for kit in kits if kit.reloads())
        self.reloader = ConfigReloader(source, _merged(kit.reloads() for kit in kits),
                                       ReloadMetrics(base.metrics.registry), config.server.config_watch_interval_s,
                                       checks=_merged(kit.checks() for kit in kits))

    def running(self) -> Iterable[Running]:
        return [Running(self.reloader.start, self.reloader.stop)] if self.reloader is not None else []


def _merged(hooks: Iterable[Mapping[str, Apply]]) -> dict[str, Apply]:
    out: dict[str, Apply] = {}
    for each in hooks:
        out.update(each)
    return out


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
        source = config.pressure.source
        out["pressure"] = {source: msgspec.to_builtins(
            PluginRegistry(PRESSURE_GROUP, "pressure source").options(source, config.pressure.options))}
    source = config.discovery.source
    out["discovery"] = {source: msgspec.to_builtins(
        PluginRegistry(DISCOVERY_GROUP, "discovery source").options(source, config.discovery.options))}
    out["hooks"] = hook_options(config.hooks)
    return out


def build_app(config: GatewayConfig, tracer_provider: Any = None, identity: WorkerIdentity | None = None,
              source: ConfigSource | None = None) -> web.Application:
    gateway = build_gateway(config, tracer_provider, identity, source)
    records = AnswerRecords(gateway.metrics)
    app = web.Application(middlewares=[records.middleware(), openai_errors(config.server.max_header_bytes)],
                          client_max_size=config.server.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app[RECORDS_KEY] = records
    add_routes(app)
    app.cleanup_ctx.extend(lifecycles(gateway.kits))
    app.on_shutdown.append(partial(_drain, gateway))  # before the server waits for the requests in flight
    return app


async def _drain(gateway: Gateway, app: web.Application) -> None:
    """Shutting down: not ready any more, and nothing new waits for capacity."""
    gateway.front.draining = True
    gateway.flow.drain()
