"""The kits every other kit builds on: the process's own parts (HTTP client, pods, metrics, keys, the proxy's
upstream side, ``/metrics``) and the state its workers and replicas share (the bus, the in-flight ledger, the
order of releases)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from gateway.api import debug
from gateway.auth import ApiKeyAuth
from gateway.background import Doorbell, LoopLagProbe
from gateway.cluster.bus import StateBus
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.replication import Sinks
from gateway.config import GatewayConfig
from gateway.core.facts import RoomFreed
from gateway.flow.release_order import ReleaseOrder, SharedReleaseOrder, SoleRelease
from gateway.http_client import HttpClient
from gateway.kits.kit import Kit, Route, Running
from gateway.load.ledger import InFlightLedger
from gateway.load.shared_table import SharedLoadTable
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.proxy.forward import Proxy


class Foundation(Kit):
    """Which worker this is, the HTTP client, the pods, the metrics (served at ``/metrics``), the loop-lag
    probe, the API keys, and the proxy's upstream side (``proxy``: the generating routes and the Responses
    API's send through it)."""

    name = "foundation"

    def __init__(self, config: GatewayConfig, identity: WorkerIdentity) -> None:
        self.config = config
        self.identity = identity
        self.http = HttpClient()
        self.pods = PodRegistry(config.pods, config.health)
        self.metrics = GatewayMetrics()
        self.loop_lag = LoopLagProbe(config.server.loop_lag_interval_s, self.metrics.loop_lag.observe)
        self.auth = ApiKeyAuth(config.auth)
        self.proxy = Proxy(self.pods, self.metrics, self.http, config.timeouts, config.auth, config.server,
                           self.loop_lag.stalled_since)

    def running(self) -> Iterable[Running]:
        # First up, last down: everything else talks through the client.
        return [Running(self.http.start, self.http.stop), Running(self.loop_lag.start, self.loop_lag.stop)]

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/metrics", partial(debug.metrics, self.auth, self.metrics, self.identity))]


class SharedState(Kit):
    """What this worker tells its siblings and replicas, and hears from them (``shared_state``): the bus, the
    load table the workers share, the requests in flight, and who releases a held request next."""

    name = "shared_state"
    requires = ("foundation",)

    def __init__(self, config: GatewayConfig, base: Foundation) -> None:
        self._base = base
        identity = base.identity
        self.shared_load = (SharedLoadTable(identity.load_table, identity.index, identity.count)
                            if identity.count > 1 else None)
        self.bus = StateBus(config.shared_state, identity, base.metrics.registry, base.loop_lag.stalled_since)
        self.sinks = Sinks.of(self.bus)
        # Rung as pods free up (here, or in a sibling worker that tells us); flow control answers.
        self.room_freed = Doorbell()
        self.bus.on((RoomFreed,), lambda origin, fact: self.room_freed.ring())
        self.release_order: ReleaseOrder = (
            SharedReleaseOrder(identity.release_order, identity.index, identity.count, self.room_freed,
                               wake_others=partial(self.bus.tell_siblings, RoomFreed()))
            if identity.count > 1 else SoleRelease(self.room_freed))
        self.ledger = InFlightLedger(self.shared_load, self.sinks.ledger, freed=self.release_order.freed)

    def running(self) -> Iterable[Running]:
        return [Running(self.bus.start, self.bus.stop)]

    def routes(self) -> Iterable[Route]:
        base = self._base
        return [Route("GET", "/debug/workers", partial(debug.workers_page, base.auth, base.identity, base.pods,
                                                       self.shared_load, self.ledger, self.bus))]
