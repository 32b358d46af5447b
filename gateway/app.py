"""Builds the gateway's aiohttp ``Application`` from a config: creates every component and wires them.

Nothing else in the package holds global state; tests build as many independent apps as they like.
Components with a lifetime (the HTTP client, health checks, KV subscribers, background loops) start in
order through aiohttp's ``cleanup_ctx`` and stop in reverse order, each one stopped even if another
fails to stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from gateway.admission import SloPolicy
from gateway.api.middleware import openai_errors
from gateway.api.records import RECORDS_KEY, AnswerRecords
from gateway.api.routes import add_routes
from gateway.auth import ApiKeyAuth
from gateway.backends.discovery import DiscoveryContext, PodSetApplier
from gateway.backends.health import HealthChecker
from gateway.backends.registry import Pod, PodRegistry
from gateway.backends.scraper import MetricsScraper
from gateway.background import Doorbell, LoopLagProbe
from gateway.cluster.bus import StateBus
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.replication import Sinks, replicate
from gateway.cluster.sibling_responses import SiblingResponses
from gateway.components import GATEWAY_KEY, FrontDoor, Gateway
from gateway.config import ConfigSource, GatewayConfig, ModelsConfig
from gateway.config_reload import ConfigReloader, ReloadMetrics
from gateway.core.facts import RoomFreed
from gateway.fleet import PodMembership, health_changed
from gateway.flow.controller import FlowController
from gateway.flow.metrics import FlowLabels, FlowMetrics
from gateway.flow.release_order import SharedReleaseOrder, SoleRelease
from gateway.flow.saturation import SaturationDetector
from gateway.flow.service_counters import ServiceCounters, WorkflowFlows
from gateway.http_client import HttpClient
from gateway.kv._blockindex import BlockIndex
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.free_queue import FreeQueues
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriptions import KvEventService, KvMetricsCollector
from gateway.kv.verification import PredictionVerifier
from gateway.kv.working_set import ResumableWorkingSet
from gateway.limits.enforcer import KeyLimits, key_rates
from gateway.limits.shared import SharedUsage
from gateway.limits.usage import UsageTally
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.load.pressure_modes import PressureModes
from gateway.load.shared_table import SharedLoadTable
from gateway.load.slo_profiles import ProfileStore
from gateway.metrics import GatewayMetrics
from gateway.models.adapters import AdapterLoader, AdapterPlacement, AdapterUse
from gateway.models.rules import ModelRules
from gateway.plugin_registry import PluginRegistry
from gateway.pressure.monitor import PressureContext, PressureMonitor, PressureSource, PressureSourceUnavailable
from gateway.proxy.forward import Proxy
from gateway.request.context_steps import (
    CacheRecency,
    ContextPlacement,
    ContextResolution,
    PlacementLosses,
    RoomForNewContexts,
    RoutedPrefix,
)
from gateway.request.director import NoPlanner, RequestDirector
from gateway.request.disaggregation import PrefillLegs
from gateway.request.flow_control import FlowControlStep
from gateway.request.identity import KeyIdentity
from gateway.request.limits import KeyLimitsStep, UsageAccounting
from gateway.request.models import AdapterTracking, ModelUse
from gateway.request.observers import (
    AccessLog,
    OutputLearning,
    PredictionCheck,
    RequestMetrics,
    RoutingMetrics,
    StepMetrics,
)
from gateway.request.pipeline import RequestPipeline
from gateway.request.responses import ResponsesState
from gateway.request.steps import LoadEstimation, PromptTokenization, WorkflowPlanning
from gateway.request.validation import RequestValidation
from gateway.responses.store import MemoryResponses, RedisResponses, ResponsesMetrics, ResponseStore
from gateway.routing.policy import PolicyContext
from gateway.routing.profiles import POLICY_GROUP, Profiles
from gateway.routing.router import Router
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.actions import CacheActionExecutor, CacheController
from gateway.workflow.context import ContextSignals
from gateway.workflow.keep_warm import KeepWarm
from gateway.workflow.planning import WorkflowService
from gateway.workflow.refresh import Refresher
from gateway.workflow.sessions import SessionAffinity
from gateway.workflow.tracker import WorkflowTracker

CONTROLLER_GROUP = "gateway.cache_controllers"
PRESSURE_GROUP = "gateway.pressure_sources"
DISCOVERY_GROUP = "gateway.discovery_sources"

log = logging.getLogger("gateway.app")
SLOW_STOP_S = 2.0  # a component that takes longer to stop is named in the log: a slow shutdown says who


def build_gateway(config: GatewayConfig, tracer_provider: Any = None, identity: WorkerIdentity | None = None,
                  source: ConfigSource | None = None) -> Gateway:
    """Every component, wired. ``tracer_provider``: an OpenTelemetry provider to trace with (tracing
    on), instead of the OTLP exporter the ``OTEL_*`` variables configure. ``identity``: which worker of
    ``serve --workers N`` this is (none: the only one). ``source``: where ``config`` was read from, to
    reload it (none: it is not reloaded)."""
    identity = identity or WorkerIdentity.single()
    http = HttpClient()
    pods = PodRegistry(config.pods, config.health)
    metrics = GatewayMetrics()
    loop_lag = LoopLagProbe(config.server.loop_lag_interval_s, metrics.loop_lag.observe)
    shared_load = (SharedLoadTable(identity.load_table, identity.index, identity.count)
                   if identity.count > 1 else None)
    bus = StateBus(config.shared_state, identity, metrics.registry, loop_lag.stalled_since)
    sinks = Sinks.of(bus)
    room_freed = Doorbell()  # rung as pods free up (here, or in a sibling worker that tells us); flow control answers
    bus.on((RoomFreed,), lambda origin, fact: room_freed.ring())
    release_order = (SharedReleaseOrder(identity.release_order, identity.index, identity.count, room_freed,
                                        wake_others=partial(bus.tell_siblings, RoomFreed()))
                     if identity.count > 1 else SoleRelease(room_freed))
    ledger = InFlightLedger(shared_load, sinks.ledger, freed=release_order.freed)
    modes = PressureModes()
    lc = config.load
    profiles = ProfileStore(lc.redis_url, lc.profile_refresh_s)
    load = PendingLoad(profiles, ledger, lc.default_capacity, lambda name: deployment_of(pods, name),
                       lc.embedding_share, blocked=modes.in_emergency)
    keeping_warm = config.workflow.enabled and config.workflow.keep_warm.enabled
    queues = FreeQueues() if keeping_warm else None
    ki = config.kv_index
    # With the host's indexers (gateway/indexer.py), this worker reads the index they write.
    host_index = ([BlockIndex(path=identity.index_path(shard), writer=False) for shard in range(ki.ingest_processes)]
                  if identity.index_dir is not None else None)
    index = PrefixIndex(ki.max_blocks_per_view, ki.speculative_ttl_s, sinks.index,
                        reported_block_size=partial(reported_block_size, load), evictions=queues, stores=host_index,
                        max_views=ki.max_views)
    approximate = ApproximatePrefixIndex()
    kv = KvEventService(index)
    metrics.registry.register(KvMetricsCollector(kv, exports_host=identity.index == 0))
    tokens = TokenizationService(config.tokenization, pods, metrics, http, ledger)
    predictor = OutputLengthPredictor(lc.predictor_window_s, lc.predictor_slot_s, lc.cold_start,
                                      lc.max_output_tokens, lc.predictor_percentile)
    working_set = ResumableWorkingSet(config.placement, ledger, sinks.working_set,
                                      anonymous_prefix=f"anon-{identity.origin}-")
    capacity_of = kv_capacity(pods, load)
    fc = config.flow_control
    service = ServiceCounters(sinks.flows)
    detector = SaturationDetector(fc.saturation, ledger, load, config.admission.enabled, flow_control=fc.enabled,
                                  active_flows=service.active_flows)
    adapter_use = AdapterUse(sinks.adapters)
    adapter_placement = AdapterPlacement(adapter_use, load.engine, lambda pod: detector.saturated_by(pod) is not None,
                                         config.models.lora)
    policies = PluginRegistry(POLICY_GROUP, "routing policy")
    router = Router(pods, policies, config.routing.policy, config.routing.options,
                    PolicyContext(pods=pods, index=index, approximate=approximate, metrics=metrics, load=load,
                                  ledger=ledger, working_set=working_set, capacity_of=capacity_of,
                                  adapter_placement=adapter_placement),
                    max_candidates=config.routing.max_candidates, profiles=config.routing.profiles)
    wc = config.workflow
    tracker = WorkflowTracker(wc, ledger, sinks.tracker)
    auth = ApiKeyAuth(config.auth)
    executor = CacheActionExecutor(tracker, working_set, pods, metrics, cache_controllers(wc.controller), http,
                                   hard_flush=wc.hard_flush, may_flush_pod=auth.may_flush_pod,
                                   retries=wc.flush_retries,
                                   retry_base_s=wc.flush_retry_base_s)
    sessions = SessionAffinity(ledger, wc.max_sessions, sinks.sessions)
    workflow_flows = WorkflowFlows(publish=sinks.flows)
    signals = ContextSignals(wc.session_headers)
    rules = ModelRules(config.models, signals, sinks.models)
    adapters = AdapterLoader(config.models, pods, http, adapter_use, adapter_placement, metrics.registry)
    usage = SharedUsage(identity.origin, sinks.limits, partitioned=lambda: bus.redis_up is False,
                        stalled=loop_lag.stalled_within)
    replicate(bus, ledger, tracker, sessions, working_set, index, service, workflow_flows, rules, adapter_use, usage)
    flow_metrics = FlowMetrics(metrics.registry, FlowLabels.of_keys(lambda: flow.config, config.auth.keys))
    flow = FlowController(fc, pods, detector, service, room_freed, flow_metrics, release_order)

    key_tenants = {k.name: k.tenant for k in config.auth.keys if k.name and k.tenant}

    def tenant_of(key: str) -> str:  # the key's own config, else as flow control tells it (reloaded with it)
        return key_tenants.get(key) or flow.config.keys.get(key, key)

    limits = KeyLimits(config.limits, usage, tenant_of, key_rates(config.auth.keys))
    key_limits = KeyLimitsStep(limits)
    usage_tally = UsageTally(metrics.registry)
    workflows = WorkflowService(wc, tracker, sessions, executor, modes, signals)
    proxy = Proxy(pods, metrics, http, config.timeouts, config.auth, config.server, loop_lag.stalled_since)
    # SLO admission and flow control hold requests in one queue, the flow controller's.
    admit = (FlowControlStep(flow, SloPolicy(config.admission), workflow_flows, pods, flow_metrics)
             if fc.enabled or config.admission.enabled else None)
    verifier = PredictionVerifier(config.verification, metrics)
    validation = RequestValidation(pods, auth, config.server, rules.is_public)

    def served(model: str) -> bool:  # a name the gateway answers for: a metrics label (the rest are "unknown")
        return rules.is_public(model) or pods.knows_model(model)

    responses_metrics = ResponsesMetrics(metrics.registry)
    own_responses, response_store = responses_stores(config, identity, responses_metrics)
    responses = ResponsesState(config.responses, response_store, pods, responses_metrics)
    planning = WorkflowPlanning(workflows)
    losses = PlacementLosses(metrics)
    placement = ContextPlacement(index, working_set, losses)
    routed = RoutedPrefix(index, approximate)
    steps = StepMetrics(metrics)
    tracking = AdapterTracking(adapter_use)
    keep_warm = recency = None
    if queues is not None:
        keep_warm = KeepWarm(wc.keep_warm, pods, working_set, queues, index, load, ledger, capacity_of,
                             Refresher(pods, config.auth, http, metrics), metrics, client_due=flow.waits_for)
        recency = CacheRecency(index, queues, keep_warm, working_set)
    pipeline = RequestPipeline(
        resolve=[validation, KeyIdentity(lambda: flow.policy, metrics.registry), responses],
        prepare=[PromptTokenization(pods, tokens, verifier, config.server, limits.counts_input),
                 ContextResolution(pods, index, working_set, signals),
                 LoadEstimation(pods, load, predictor, metrics, config.admission.enabled)],
        # A starting context waits for KV room first: a request flow control lets go is dispatched at once.
        admit=[key_limits,
               *([RoomForNewContexts(pods, working_set, capacity_of, config.placement.hold_new_s, metrics)]
                 if config.placement.hold_new_s else []), *([admit] if admit else [])],
        # Cache recency reads a context as it was before this request: before placement holds it anew.
        dispatch=[RoutingMetrics(metrics), routed, *([recency] if recency else []), placement, planning,
                  *([admit] if admit else []), tracking],
        finish=[*([admit] if admit else []), planning, placement, *([recency] if recency else []), tracking],
        complete=[*([admit] if admit else []), *([PredictionCheck(verifier)] if config.verification.enabled else []),
                  OutputLearning(predictor, metrics), RequestMetrics(metrics, served),
                  ModelUse(rules, metrics.registry), key_limits, UsageAccounting(usage_tally, tenant_of), steps,
                  AccessLog()],
    )
    if config.tracing.enabled:
        from gateway.request import tracing  # the otel extra: imported only when tracing is on

        tracer_provider = tracer_provider or tracing.tracer_provider()
        pipeline = tracing.traced(pipeline, tracer_provider.get_tracer(tracing.INSTRUMENTATION))
    directing = {"max_retries": config.routing.max_retries, "default_consumption": load.default_consumption,
                 "allow_strategy_header": config.routing.allow_strategy_header,
                 "max_body_bytes": config.server.max_body_bytes}
    prefill = PrefillLegs(config.disaggregation, pods, router, ledger, proxy, metrics, dispatched=[routed],
                          default_consumption=load.default_consumption)
    director = RequestDirector(pipeline, router, planning, ledger, proxy, pods, prefill=prefill, models=rules,
                               adapters=adapters, **directing)
    # Requests a pod answers without inferring (Anthropic's count_tokens): no tokenization, admission,
    # workflow or prediction steps, since nothing is cached or learnt by them.
    counting = RequestDirector(RequestPipeline(resolve=[validation],
                                               complete=[RequestMetrics(metrics, served), AccessLog()]),
                               router, NoPlanner(), ledger, proxy, pods, models=rules, **directing)
    pressure = None
    if config.pressure.enabled:
        readings = pressure_source(config, PressureContext(load, working_set, capacity_of))
        pressure = PressureMonitor(config.pressure, pods, readings, tracker, working_set, executor, modes, metrics)
    health = HealthChecker(pods, http, config.health, lambda pod: health_changed(metrics, kv, pod),
                           share=1 / identity.count, loop_stalled=loop_lag.stalled_since)
    membership = PodMembership(health, metrics, kv, load, profiles, approximate, sessions, working_set, modes,
                               ledger)
    discovery = None
    if config.discovery.source != "static":
        discovery = PodSetApplier(pods, discovery_source(config), membership.added, membership.removed)
    scraper = (MetricsScraper(pods, load.engine, http, lc.scrape_interval_s,
                              max_per_s=lc.max_scrapes_per_s / identity.count, busy=lambda pod: ledger.on_pod(pod) > 0)
               if lc.scrape_interval_s > 0 else None)
    reloader = None
    if source is not None and source.path:

        def reconfigure_models(models: ModelsConfig) -> None:
            rules.reconfigure(models)
            adapters.reconfigure(models)

        reloader = ConfigReloader(source, {"flow_control": flow.reconfigure, "models": reconfigure_models,
                                           "limits": limits.reconfigure, "routing": router.reconfigure},
                                  ReloadMetrics(metrics.registry), config.server.config_watch_interval_s,
                                  checks={"routing": router.check})
    front = FrontDoor(auth, director, counting, proxy, pods, rules, responses, workflows, config.server)
    return Gateway(
        config=config, front=front, http=http, pods=pods, metrics=metrics, ledger=ledger, router=router,
        steps=steps, adapters=adapters, limits=limits, usage=usage_tally, kv=kv, tokens=tokens,
        profiles=profiles, load=load, flow=flow, working_set=working_set, capacity_of=capacity_of, health=health,
        verifier=verifier, membership=membership, modes=modes, identity=identity, bus=bus, losses=losses,
        keep_warm=keep_warm, shared_load=shared_load, loop_lag=loop_lag,
        pressure=pressure, scraper=scraper, discovery=discovery, reloader=reloader, own_responses=own_responses,
        tracer_provider=tracer_provider if config.tracing.enabled else None,
    )


def responses_stores(config: GatewayConfig, identity: WorkerIdentity, metrics: ResponsesMetrics
                     ) -> tuple[MemoryResponses | None, ResponseStore]:
    """Where the Responses API's responses are kept: Redis with ``shared_state.redis_url``; else this
    process's memory, which, with several workers, asks its siblings for the others' (the first of the
    pair: this worker's own, which the siblings may ask for)."""
    shared = config.shared_state
    if shared.redis_url:
        return None, RedisResponses(config.responses, shared.redis_url, shared.redis_timeout_s, metrics)
    own = MemoryResponses(config.responses, metrics)
    return own, SiblingResponses(own, identity) if identity.count > 1 else own


def kv_capacity(pods: PodRegistry, load: PendingLoad) -> Callable[[str], float | None]:
    """A pod's KV capacity in tokens: its config's, else what its engine's metrics said, else unknown."""

    def capacity_of(name: str) -> float | None:
        pod = pods.get(name)
        if pod is not None and pod.config.kv_capacity_tokens:
            return float(pod.config.kv_capacity_tokens)
        stats = load.engine.get(name)
        return stats.kv_capacity_tokens if stats is not None and stats.kv_capacity_tokens > 0 else None

    return capacity_of


def reported_block_size(load: PendingLoad, pod: str) -> int | None:
    """The block size the pod's engine metrics say (vLLM's ``cache_config_info``), if they say one."""
    stats = load.engine.get(pod)
    return int(stats.block_size) if stats is not None and stats.block_size > 0 else None


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


def discovery_source(config: GatewayConfig) -> Any:
    plugins = PluginRegistry(DISCOVERY_GROUP, "discovery source")
    return plugins.build(config.discovery.source, DiscoveryContext(list(config.pods)), config.discovery.options)


def pressure_source(config: GatewayConfig, context: PressureContext) -> PressureSource:
    plugins = PluginRegistry(PRESSURE_GROUP, "pressure source")
    try:
        return plugins.build(config.pressure.source, context, config.pressure.options)
    except PressureSourceUnavailable as exc:
        log.warning("pressure source %s is unavailable here (%s); using engine metrics", config.pressure.source, exc)
        return plugins.build("engine_metrics", context)


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
    return out


def deployment_of(pods: PodRegistry, name: str) -> str:
    pod = pods.get(name)
    return (pod.config.deployment or pod.name) if pod else name


Lifecycle = Callable[[web.Application], AsyncIterator[None]]


def lifecycle(start: Callable[[], Awaitable[None] | None], stop: Callable[[], Awaitable[None]] | None = None
              ) -> Lifecycle:
    """A ``cleanup_ctx`` entry: ``start`` when the app starts, ``stop`` when it stops."""

    async def run(app: web.Application) -> AsyncIterator[None]:
        started = start()
        if started is not None:
            await started
        yield
        if stop is not None:
            began = time.monotonic()
            await stop()
            if (took := time.monotonic() - began) > SLOW_STOP_S:
                log.warning("stopping %s took %.1f s", getattr(stop, "__qualname__", stop), took)

    return run


def lifecycles(gw: Gateway) -> list[Lifecycle]:
    """The components with a lifetime, in start order (they stop in reverse)."""
    out = [
        lifecycle(gw.http.start, gw.http.stop),  # first up, last down: everything else talks through it
        lifecycle(gw.loop_lag.start, gw.loop_lag.stop),
        lifecycle(gw.bus.start, gw.bus.stop),
        lifecycle(gw.front.responses.store.start, gw.front.responses.store.stop),
        lifecycle(gw.health.start, gw.health.stop),
        lifecycle(lambda: gw.membership.attach_all(gw.pods), gw.kv.stop),
    ]
    if gw.discovery is not None:
        out.append(lifecycle(gw.discovery.start, gw.discovery.stop))
    out.append(lifecycle(gw.profiles.start, gw.profiles.stop))
    if gw.scraper is not None:
        out.append(lifecycle(gw.scraper.start, gw.scraper.stop))
    out += [lifecycle(gw.flow.start, gw.flow.stop), lifecycle(gw.front.workflows.start, gw.front.workflows.stop),
            lifecycle(gw.adapters.start, gw.adapters.stop)]
    if gw.keep_warm is not None:
        out.append(lifecycle(gw.keep_warm.start, gw.keep_warm.stop))
    if gw.pressure is not None:
        out.append(lifecycle(gw.pressure.start, gw.pressure.stop))
    if gw.reloader is not None:
        out.append(lifecycle(gw.reloader.start, gw.reloader.stop))
    if gw.tracer_provider is not None:  # flush the spans still batched
        out.append(lifecycle(lambda: None, lambda: asyncio.to_thread(gw.tracer_provider.shutdown)))
    # Last: the tokenizers load on a thread (a second or more of CPU), while the gateway listens, not before.
    return [*out, lifecycle(gw.tokens.start, gw.tokens.stop)]


def build_app(config: GatewayConfig, tracer_provider: Any = None, identity: WorkerIdentity | None = None,
              source: ConfigSource | None = None) -> web.Application:
    gateway = build_gateway(config, tracer_provider, identity, source)
    records = AnswerRecords(gateway.metrics)
    app = web.Application(middlewares=[records.middleware(), openai_errors(config.server.max_header_bytes)],
                          client_max_size=config.server.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app[RECORDS_KEY] = records
    add_routes(app)
    app.cleanup_ctx.extend(lifecycles(gateway))
    app.on_shutdown.append(partial(_drain, gateway))  # before the server waits for the requests in flight
    return app


async def _drain(gateway: Gateway, app: web.Application) -> None:
    """Shutting down: not ready any more, and nothing new waits for capacity."""
    gateway.front.draining = True
    gateway.flow.drain()
