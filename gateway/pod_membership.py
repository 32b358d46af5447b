"""Pods joining and leaving the fleet: what that means for every component that keeps state per pod.

Owner: nothing of its own; it calls each owner's own method (the KV service subscribes and unsubscribes,
the ledger, working set, session map, pressure modes and approximate index forget the pod).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.subscriptions import KvEventService
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.pressure_modes import PressureModes
from gateway.load.slo_profiles import ProfileStore
from gateway.metrics import GatewayMetrics
from gateway.pods.health import HealthChecker
from gateway.pods.registry import Pod, PodRegistry
from gateway.workflow.sessions import SessionAffinity


@dataclass(eq=False, slots=True)
class PodMembership:
    """What joining or leaving the fleet means for every component that keeps state per pod."""

    health: HealthChecker
    metrics: GatewayMetrics
    kv: KvEventService
    load: PendingLoad
    profiles: ProfileStore
    approximate: ApproximatePrefixIndex
    sessions: SessionAffinity
    working_set: ResumableWorkingSet
    modes: PressureModes
    ledger: InFlightLedger

    def attach(self, pod: Pod) -> None:
        health_changed(self.metrics, self.kv, pod)
        name, load = pod.name, self.load
        self.metrics.watch_pod(name, lambda: load.ledger.on_pod(name), lambda: load.load(name),
                               lambda: stats.kv_usage if (stats := load.engine.get(name)) else 0.0)
        self.metrics.pod_role.labels(name, pod.config.role).set(1)
        self.kv.add_pod(pod)
        self.profiles.learn_models(pod.models)

    def attach_all(self, pods: PodRegistry) -> None:
        for pod in pods.all():
            self.attach(pod)

    async def added(self, pod: Pod) -> None:
        await self.health.check(pod, initial=True, refresh_models=True)
        self.attach(pod)

    async def removed(self, name: str) -> None:
        await self.kv.remove_pod(name)
        self.approximate.forget_pod(name)
        self.sessions.forget_pod(name)
        self.working_set.forget_pod(name)
        self.modes.forget_pod(name)
        self.ledger.forget_pod(name)
        self.metrics.forget_pod(name)


def health_changed(metrics: GatewayMetrics, kv: KvEventService, pod: Pod) -> None:
    """A pod turned healthy or unhealthy: export it, and let its KV subscribers know."""
    metrics.pod_healthy.labels(pod.name).set(1 if pod.healthy else 0)
    kv.pod_health_changed(pod)
