"""The fleet kit: which pods there are (static, or from a discovery source), whether each answers (the
health checks), and what joins and leaves with a pod (its KV events' subscriber, its load, its sessions)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.config import GatewayConfig
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.kit import Kit, Running
from gateway.kits.state import KvKit, LoadKit
from gateway.plugin_registry import PluginRegistry
from gateway.pod_membership import PodMembership, health_changed
from gateway.pods.discovery import DiscoveryContext, PodSetApplier
from gateway.pods.health import HealthChecker

DISCOVERY_GROUP = "gateway.discovery_sources"


class FleetKit(Kit):
    """The health checker, the pods' membership, and discovery (``None`` with ``discovery.source: static``)."""

    name = "fleet"
    requires = ("foundation",)  # the checks go through the HTTP client

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit, kv: KvKit) -> None:
        metrics, events, identity = base.metrics, kv.events, base.identity
        self.pods = base.pods
        self.health = HealthChecker(base.pods, base.http, config.health,
                                    lambda pod: health_changed(metrics, events, pod), share=1 / identity.count,
                                    loop_stalled=base.loop_lag.stalled_since)
        self.membership = PodMembership(self.health, metrics, events, load.load, load.profiles, kv.approximate,
                                        kv.sessions, kv.working_set, load.modes, shared.ledger)
        self.events = events
        self.discovery = (PodSetApplier(base.pods, discovery_source(config), self.membership.added,
                                        self.membership.removed)
                          if config.discovery.source != "static" else None)

    def running(self) -> Iterable[Running]:
        # The KV events' subscribers start as each pod joins, and stop together.
        parts = [Running(self.health.start, self.health.stop),
                 Running(lambda: self.membership.attach_all(self.pods), self.events.stop)]
        if self.discovery is not None:
            parts.append(Running(self.discovery.start, self.discovery.stop))
        return parts


def discovery_source(config: GatewayConfig) -> Any:
    plugins = PluginRegistry(DISCOVERY_GROUP, "discovery source")
    return plugins.build(config.discovery.source, DiscoveryContext(list(config.pods)), config.discovery.options)
