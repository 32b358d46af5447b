"""Builds the gateway's aiohttp ``Application`` from a config: creates every component and wires them.

Nothing else in the package holds global state; tests build as many independent apps as they like.
Background tasks (health checks) start in ``on_startup`` and stop in ``on_cleanup``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from gateway.admission import AdmissionController
from gateway.api.auth import ApiKeyAuth
from gateway.api.middleware import openai_errors
from gateway.api.routes import add_routes
from gateway.backends.discovery import DiscoveryContext, DiscoverySource, PodSetApplier
from gateway.backends.health import HealthChecker
from gateway.backends.registry import Pod, PodRegistry
from gateway.backends.scraper import MetricsScraper
from gateway.config import GatewayConfig
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.index import PrefixIndex
from gateway.kv.service import KvEventService, KvMetricsCollector
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.pending import PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.load.profiles import ProfileStore
from gateway.metrics import GatewayMetrics
from gateway.plugin_registry import PluginRegistry
from gateway.pressure import PressureContext, PressureMonitor, PressureSource, PressureSourceUnavailable
from gateway.proxy import Proxy
from gateway.routing.policy import PolicyContext
from gateway.routing.router import Router
from gateway.tokenization.service import TokenizationService
from gateway.workflow.actions import CacheActionExecutor, CacheController
from gateway.workflow.service import WorkflowService
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import WorkflowTracker

POLICY_GROUP = "gateway.policies"
CONTROLLER_GROUP = "gateway.cache_controllers"
PRESSURE_GROUP = "gateway.pressure_sources"
DISCOVERY_GROUP = "gateway.discovery_sources"

log = logging.getLogger("gateway.app")


@dataclass(eq=False)
class Gateway:
    """Every component of one gateway instance."""

    config: GatewayConfig
    pods: PodRegistry
    metrics: GatewayMetrics
    router: Router
    proxy: Proxy
    auth: ApiKeyAuth
    policies: PluginRegistry
    kv: KvEventService
    tokens: TokenizationService
    profiles: ProfileStore
    load: PendingLoad
    admission: AdmissionController
    workflows: WorkflowService
    working_set: ResumableWorkingSet
    capacity_of: Callable[[str], float | None]
    pressure: PressureMonitor | None = None
    scraper: MetricsScraper | None = None
    discovery: PodSetApplier | None = None
    health: HealthChecker | None = None
    session: aiohttp.ClientSession | None = None
    draining: bool = False


GATEWAY_KEY = web.AppKey("gateway", Gateway)


def build_gateway(config: GatewayConfig) -> Gateway:
    pods = PodRegistry(config.pods, config.health)
    metrics = GatewayMetrics()
    policies = PluginRegistry(POLICY_GROUP, "routing policy")
    index = PrefixIndex(config.kv_index.max_blocks_per_view, config.kv_index.speculative_ttl_s)
    kv = KvEventService(index)
    metrics.registry.register(KvMetricsCollector(kv))
    tokens = TokenizationService(config.tokenization, pods, metrics)
    lc = config.load
    profiles = ProfileStore(lc.redis_url, lc.profile_refresh_s)
    load = PendingLoad(profiles, lc.default_capacity, lambda name: deployment_of(pods, name), lc.embedding_share)
    predictor = OutputLengthPredictor(lc.predictor_window_s, lc.predictor_slot_s, lc.cold_start,
                                      lc.max_output_tokens, lc.predictor_percentile)
    admission = AdmissionController(config.admission, load, metrics)
    working_set = ResumableWorkingSet(config.placement)
    capacity_of = kv_capacity(pods, load)
    context = PolicyContext(pods=pods, index=index, approximate=ApproximatePrefixIndex(), metrics=metrics,
                            load=load, working_set=working_set, capacity_of=capacity_of)
    router = Router(pods, policies, config.routing.policy, config.routing.options, context)
    wc = config.workflow
    tracker = WorkflowTracker(wc)
    executor = CacheActionExecutor(tracker, working_set, pods, metrics, cache_controllers(wc.controller),
                                   hard_flush=wc.hard_flush, retries=wc.flush_retries,
                                   retry_base_s=wc.flush_retry_base_s)
    workflows = WorkflowService(wc, tracker, SessionAffinity(wc.max_sessions), executor, load)
    auth = ApiKeyAuth(config.auth)
    proxy = Proxy(pods, router, metrics, tokens, load, predictor, admission, workflows, config.routing,
                  config.timeouts, config.auth, auth, config.server)
    pressure = None
    if config.pressure.enabled:
        source = pressure_source(config, PressureContext(load, dict(config.pressure.options), working_set,
                                                         capacity_of))
        pressure = PressureMonitor(config.pressure, pods, source, tracker, working_set, executor, load, metrics)
    return Gateway(config=config, pods=pods, metrics=metrics, router=router, proxy=proxy,
                   auth=auth, policies=policies, kv=kv, tokens=tokens,
                   profiles=profiles, load=load, admission=admission, workflows=workflows, pressure=pressure,
                   working_set=working_set, capacity_of=capacity_of)


def kv_capacity(pods: PodRegistry, load: PendingLoad) -> Callable[[str], float | None]:
    """A pod's KV capacity in tokens: its config's, else what its engine's metrics said, else unknown."""

    def capacity_of(name: str) -> float | None:
        pod = pods.get(name)
        if pod is not None and pod.config.kv_capacity_tokens:
            return float(pod.config.kv_capacity_tokens)
        stats = load.engine.get(name)
        return stats.kv_capacity_tokens if stats is not None and stats.kv_capacity_tokens > 0 else None

    return capacity_of


def cache_controllers(choice: str) -> Callable[[Pod], CacheController | None]:
    """Per pod, the controller named by config, or (``auto``) the one matching the pod's engine."""
    plugins = PluginRegistry(CONTROLLER_GROUP, "cache controller")
    if choice != "auto":
        plugins.load(choice)  # fail at start on an unknown name
    built: dict[str, CacheController | None] = {}

    def controller_for(pod: Pod) -> CacheController | None:
        name = pod.config.flavor if choice == "auto" else choice
        if name not in built:
            built[name] = plugins.load(name)()
        return built[name]

    return controller_for


def discovery_source(config: GatewayConfig) -> DiscoverySource:
    plugins = PluginRegistry(DISCOVERY_GROUP, "discovery source")
    return plugins.load(config.discovery.source)(DiscoveryContext(list(config.pods), dict(config.discovery.options)))


def pressure_source(config: GatewayConfig, context: PressureContext) -> PressureSource:
    plugins = PluginRegistry(PRESSURE_GROUP, "pressure source")
    try:
        return plugins.load(config.pressure.source)(context)
    except PressureSourceUnavailable as exc:
        log.warning("pressure source %s is unavailable here (%s); using engine metrics", config.pressure.source, exc)
        return plugins.load("engine_metrics")(context)


def deployment_of(pods: PodRegistry, name: str) -> str:
    pod = pods.get(name)
    return (pod.config.deployment or pod.name) if pod else name


def build_app(config: GatewayConfig) -> web.Application:
    gateway = build_gateway(config)
    app = web.Application(middlewares=[openai_errors(config.server.max_header_bytes)],
                          client_max_size=config.server.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    add_routes(app, gateway)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def _start(app: web.Application) -> None:
    gw = app[GATEWAY_KEY]
    # One pooled session for all upstream traffic; no per-host cap, since pods are few and hot.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    gw.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    gw.proxy.session = gw.tokens.session = gw.session
    await asyncio.to_thread(gw.tokens.load)

    def on_health_change(pod: Pod) -> None:
        gw.metrics.pod_healthy.labels(pod.name).set(1 if pod.healthy else 0)
        gw.kv.pod_health_changed(pod)

    gw.health = HealthChecker(gw.pods, gw.session, gw.config.health, on_health_change)
    await gw.health.start()

    def attach(pod: Pod) -> None:
        on_health_change(pod)
        gw.metrics.watch_pod(pod, gw.load)
        gw.kv.add_pod(pod)
        gw.profiles.known_models |= pod.models

    async def pod_added(pod: Pod) -> None:
        await gw.health.check(pod, initial=True, refresh_models=True)  # type: ignore[union-attr]
        attach(pod)

    async def pod_removed(name: str) -> None:
        await gw.kv.remove_pod(name)
        gw.workflows.sessions.forget_pod(name)
        gw.working_set.forget_pod(name)

    for pod in gw.pods.all():
        attach(pod)
    if gw.config.discovery.source != "static":
        gw.discovery = PodSetApplier(gw.pods, pod_added, pod_removed)
        gw.discovery.start(discovery_source(gw.config))
    await gw.profiles.start()
    if gw.config.load.scrape_interval_s > 0:
        gw.scraper = MetricsScraper(gw.pods, gw.load.engine, gw.session, gw.config.load.scrape_interval_s)
        gw.scraper.start()
    gw.admission.start()
    gw.workflows.executor.session = gw.session
    gw.workflows.start()
    if gw.pressure:
        gw.pressure.start()


async def _stop(app: web.Application) -> None:
    gw = app[GATEWAY_KEY]
    if gw.discovery:
        await gw.discovery.stop()
    if gw.health:
        await gw.health.stop()
    await gw.kv.stop()
    await gw.admission.stop()
    await gw.workflows.stop()
    if gw.pressure:
        await gw.pressure.stop()
    if gw.scraper:
        await gw.scraper.stop()
    await gw.profiles.stop()
    if gw.session:
        await gw.session.close()
