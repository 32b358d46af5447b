"""The kits of the process as a whole: whether it takes requests (liveness, readiness, the OpenAPI document,
the drain at shutdown), its traces, and its config read again (reloading)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from gateway.api.routes import READY, healthz, openapi, readiness, readyz
from gateway.config import ConfigSource, GatewayConfig
from gateway.config_reload import ConfigReloader, ReloadMetrics
from gateway.kits.fleet import FleetKit
from gateway.kits.flow import FlowKit
from gateway.kits.foundation import Foundation
from gateway.kits.kit import Apply, Kit, Route, Running
from gateway.kits.requests import RequestsKit
from gateway.kits.state import TokensKit
from gateway.request.pipeline import RequestPipeline


class ServingKit(Kit):
    """``/healthz`` (the process answers), ``/readyz`` (it has pods, its tokenizers and is not draining) and
    ``/openapi.json``; :meth:`drain` when shutdown begins."""

    name = "serving"

    def __init__(self, requests: RequestsKit, tokens: TokensKit, fleet: FleetKit, flow: FlowKit) -> None:
        self._front = requests.front
        self._flow = flow.flow
        self.readiness = partial(readiness, self._draining, self._front.ready_pods, tokens.tokens, fleet.health)

    def _draining(self) -> bool:
        return self._front.draining

    def ready(self) -> bool:
        """Whether ``/readyz`` says ready (:func:`~gateway.api.routes.readiness`)."""
        return self.readiness()[0] == READY

    def drain(self) -> None:
        """Shutting down: not ready any more, and nothing new waits for capacity."""
        self._front.draining = True
        self._flow.drain()

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/healthz", healthz), Route("GET", "/openapi.json", openapi),
                Route("GET", "/readyz", partial(readyz, self.readiness))]


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
        appliers = _merged(kit.reloads() for kit in kits)  # the sections that apply live: those a kit reloads
        self.reloader = ConfigReloader(source, appliers, ReloadMetrics(base.metrics.registry),
                                       config.server.config_watch_interval_s,
                                       checks=_merged(kit.checks() for kit in kits), live_sections=appliers.keys())

    def running(self) -> Iterable[Running]:
        return [Running(self.reloader.start, self.reloader.stop)] if self.reloader is not None else []


def _merged(hooks: Iterable[Mapping[str, Apply]]) -> dict[str, Apply]:
    """Section → what applies it; a section more than one kit reloads (the add-ons' ``kits``) goes to each."""
    per: dict[str, list[Apply]] = {}
    for each in hooks:
        for section, apply in each.items():
            per.setdefault(section, []).append(apply)
    return {section: applies[0] if len(applies) == 1 else partial(_each, applies) for section, applies in per.items()}


def _each(applies: list[Apply], section: Any) -> None:
    for apply in applies:
        apply(section)
