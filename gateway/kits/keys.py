"""The kits of what a key may do and what it used: token and concurrency limits per key and tenant (shared
by every worker and replica) with the usage they count, and the Responses API's stored responses."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

from gateway.api import debug
from gateway.api.stored_responses import StoredResponseRoutes
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.sibling_responses import SiblingResponses
from gateway.config import GatewayConfig
from gateway.kits.flow import FlowKit
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.kit import Apply, Kit, Route, Running
from gateway.limits.enforcer import KeyLimits, key_rates
from gateway.limits.shared import SharedUsage
from gateway.limits.usage import UsageTally
from gateway.request.limits import KeyLimitsStep, UsageAccounting
from gateway.request.responses_state import ResponsesState
from gateway.responses.store import MemoryResponses, RedisResponses, ResponsesMetrics, ResponseStore


class LimitsKit(Kit):
    """Limits per key and tenant (``limits``, enforced by ``step``), the usage they share across processes,
    and the requests and tokens counted per key, tenant and model (``tally``, by ``accounting``); both on
    ``/debug/usage``."""

    name = "key_limits"

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, flow: FlowKit) -> None:
        bus = shared.bus
        self.usage = SharedUsage(base.identity.origin, shared.sinks.limits, partitioned=lambda: bus.redis_up is False,
                                 stalled=base.loop_lag.stalled_within)
        key_tenants = {k.name: k.tenant for k in config.auth.keys if k.name and k.tenant}
        controller = flow.flow

        def tenant_of(key: str) -> str:  # the key's own config, else as flow control tells it (reloaded with it)
            return key_tenants.get(key) or controller.config.keys.get(key, key)

        self.limits = KeyLimits(config.limits, self.usage, tenant_of, key_rates(config.auth.keys))
        self.step = KeyLimitsStep(self.limits)
        self.tally = UsageTally(base.metrics.registry)
        self.accounting = UsageAccounting(self.tally, tenant_of)
        self._page = partial(debug.usage_page, base.auth, base.identity.name, self.tally, self.limits)

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/debug/usage", self._page)]

    def reloads(self) -> Mapping[str, Apply]:
        return {"limits": self.limits.reconfigure}


class ResponsesKit(Kit):
    """The Responses API's stored responses (``store``; ``own``: this worker's, which its siblings may ask
    for, without Redis), the step that resolves a request's previous response (``state``), and the routes on
    stored responses (:mod:`gateway.api.stored_responses`)."""

    name = "responses"
    requires = ("foundation",)

    def __init__(self, config: GatewayConfig, base: Foundation) -> None:
        self.metrics = ResponsesMetrics(base.metrics.registry)
        self.own, store = responses_stores(config, base.identity, self.metrics)
        self.state = ResponsesState(config.responses, store, base.pods, self.metrics)
        self._routes = StoredResponseRoutes(base.auth, self.state, base.pods, base.proxy, base.http, self.own)

    def routes(self) -> Iterable[Route]:
        return self._routes.routes()

    def running(self) -> Iterable[Running]:
        return [Running(self.state.store.start, self.state.store.stop)]


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
