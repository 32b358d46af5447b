"""The workers of one gateway agree which held request goes next: the table each publishes its contender in
(a real file, mapped by each handle as by each worker process), two flow controllers deciding through it,
and the wake-up datagram that carries freed room from one worker to the others."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from gateway.background import Doorbell
from gateway.cluster.bus import StateBus
from gateway.cluster.identity import WorkerIdentity
from gateway.config import FlowControlConfig, SaturationConfig, SharedStateConfig
from gateway.core.facts import RoomFreed
from gateway.flow.controller import FlowController
from gateway.flow.flows import Flow, FlowKey
from gateway.flow.metrics import FlowMetrics
from gateway.flow.release_order import STALE_S, Contender, SharedReleaseOrder
from gateway.flow.saturation import Demand, SaturationDetector
from gateway.flow.service_counters import ServiceCounters
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.shared_table import SharedLoadTable
from gateway.load.slo_profiles import ProfileStore
from tests.unit.test_flow_control import MODEL, one_pod

LIMIT_S = 1.0


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gw-", dir="/tmp")  # short: Unix socket paths are limited to 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def handles(run_dir: str, workers: int = 2) -> list[SharedReleaseOrder]:
    """Each worker's handle on one table, as the supervisor creates it."""
    path = WorkerIdentity("r", 0, workers, run_dir).release_order
    SharedReleaseOrder.create(path, workers).close()
    return [SharedReleaseOrder(path, i, workers) for i in range(workers)]


POOL = 7


def c(priority: int, service: float, deadline: float = 130.0, pool: int = POOL) -> Contender:
    return Contender(priority, service, deadline, pool)


def test_the_higher_band_then_the_lesser_service_then_the_earlier_deadline_goes_first(run_dir):
    w0, w1 = handles(run_dir)
    now = 100.0
    assert w0.claim(c(0, 500.0), True, 2, now, LIMIT_S)  # nobody else holds anything
    w0.landed(1, now)
    # w1's contender waits for room (none yet), and was served less: w0 may not take the room before it.
    assert not w1.claim(c(0, 100.0, 140.0), False, 2, now, LIMIT_S)
    assert not w0.claim(c(0, 500.0), True, 1, now, LIMIT_S)
    assert w1.claim(c(0, 100.0, 140.0), True, 2, now, LIMIT_S)
    w1.landed(1, now)
    # The least service in the band among the others' contenders: where a flow that starts to wait is lifted.
    assert w0.floor(0, now) == 100.0 and w1.floor(0, now) == 500.0 and w0.floor(5, now) is None
    # A contender for other pods (another model) holds nobody back.
    assert w0.claim(c(0, 500.0, pool=8), True, 1, now, LIMIT_S)
    w0.landed(1, now)
    # A higher band goes before any service.
    assert w0.claim(c(5, 900.0), True, 1, now, LIMIT_S)
    w0.landed(1, now)
    assert not w1.claim(c(0, 100.0), True, 1, now, LIMIT_S)
    # Equal band and service: the earlier deadline; all equal: the lower index.
    w0.claim(c(0, 100.0, 130.0), False, 1, now, LIMIT_S)
    assert not w1.claim(c(0, 100.0, 140.0), True, 1, now, LIMIT_S)
    assert not w1.claim(c(0, 100.0, 130.0), True, 1, now, LIMIT_S)
    assert w0.claim(c(0, 100.0, 130.0), True, 1, now, LIMIT_S)


def test_a_release_on_its_way_holds_the_others_and_a_stalled_or_dead_worker_is_passed_over(run_dir):
    w0, w1 = handles(run_dir)
    assert w0.claim(c(0, 500.0), True, 2, 100.0, LIMIT_S)
    # w1 ranks first, but w0's request is not dispatched yet: the room it takes is not counted yet.
    assert not w1.claim(c(0, 1.0), True, 1, 100.1, LIMIT_S)
    assert w1.claim(c(0, 1.0), True, 1, 100.0 + LIMIT_S + 0.1, LIMIT_S)  # a transit past its limit
    w1.landed(1, 102.0)
    # w1's row, unrefreshed for STALE_S (a stalled worker), no longer holds w0 back.
    assert w0.claim(c(0, 500.0), True, 2, 102.0 + STALE_S + 0.1, LIMIT_S)
    w0.landed(1, 103.0)
    assert w1.claim(c(0, 1.0), True, 1, 103.0, LIMIT_S)
    assert w0.others_hold(103.0) and not w0.claim(c(0, 500.0), True, 1, 103.0, LIMIT_S)
    # The supervisor clears a dead worker's row: it holds and releases nothing.
    supervisor = SharedReleaseOrder(WorkerIdentity("r", 0, 2, run_dir).release_order, -1, 2)
    supervisor.clear_worker(1)
    supervisor.close()
    assert not w0.others_hold(103.0) and w0.claim(c(0, 500.0), True, 1, 103.0, LIMIT_S)
    # A worker whose last held request left withdraws its contender.
    w0.landed(1, 104.0)
    w1.claim(c(0, 1.0), False, 1, 104.0, LIMIT_S)
    assert w0.floor(0, 104.0) == 1.0
    w1.holding(0, 104.0)
    assert w0.floor(0, 104.0) is None and not w0.others_hold(104.0)


def test_freed_room_wakes_the_others_only_while_they_hold_requests(run_dir):
    woken: list[int] = []
    bells = [Doorbell(), Doorbell()]
    path = WorkerIdentity("r", 0, 2, run_dir).release_order
    SharedReleaseOrder.create(path, 2).close()
    w0, w1 = (SharedReleaseOrder(path, i, 2, bells[i], wake_others=lambda i=i: woken.append(i)) for i in range(2))
    w0.freed()
    assert woken == []  # nobody holds anything: no datagram on the request path
    w1.claim(None, False, 4, 100.0, LIMIT_S)
    w0.freed()
    assert woken == [0]
    w1.holding(0, 100.1)
    w0.freed()
    assert woken == [0]


def two_workers(run_dir: str) -> tuple[list[FlowController], list[InFlightLedger], ServiceCounters]:
    """Two workers' flow controllers in front of one pod with room for one request: each its own ledger
    writing its cell of one load table, its own handle on the release order, its own doorbell; a wake-up
    to the others rings theirs (the datagram's part is tested below). The service counters are one object:
    counters the bus has already brought level."""
    identity = WorkerIdentity("r", 0, 2, run_dir)
    SharedLoadTable.create(identity.load_table, 2).close()
    SharedReleaseOrder.create(identity.release_order, 2).close()
    counters, bells = ServiceCounters(), [Doorbell(), Doorbell()]
    config = FlowControlConfig(saturation=SaturationConfig(in_flight=1), max_wait_s=30)
    registry = one_pod()
    controllers, ledgers = [], []
    for i in range(2):
        order = SharedReleaseOrder(identity.release_order, i, 2, bells[i], wake_others=bells[1 - i].ring)
        ledger = InFlightLedger(SharedLoadTable(identity.load_table, i, 2), freed=order.freed)
        detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str),
                                      False)
        controllers.append(FlowController(config, registry, detector, counters, bells[i],
                                          FlowMetrics(CollectorRegistry()), order))
        ledgers.append(ledger)
    return controllers, ledgers, counters


async def test_room_freed_in_one_worker_goes_to_the_least_served_flow_held_in_another(run_dir):
    (x, y), (ledger_x, ledger_y), counters = two_workers(run_dir)
    pods = one_pod().candidates(MODEL)
    busy = ledger_x.dispatch("busy", "p0", 1.0, "chat")  # worker x's request fills the pod
    assert y.room_now(pods, Demand()) is None  # counted in the shared table: y sees it
    counters.charge(FlowKey("a"), 500.0)  # a has been served much more than b
    order: list[str] = []

    async def wait(name: str, flows: FlowController, ledger: InFlightLedger) -> None:
        release = await flows.hold(Flow(FlowKey(name[0])), MODEL, None, Demand(), 30.0)
        order.append(name)
        entry = ledger.dispatch(name, "p0", 1.0, "chat")  # dispatched: the pod is full again
        counters.charge(FlowKey(name[0]), 300.0)
        flows.landed(release.held)
        await asyncio.sleep(0.02)
        ledger.finish(entry)

    # b waits in y, a in x (and starts to wait after b, so it is not lifted below b's counter).
    tasks = [asyncio.create_task(wait(f"b{i}", y, ledger_y)) for i in range(2)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(wait(f"a{i}", x, ledger_x)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert (x.queued, y.queued) == (3, 2) and x.room_now(pods, Demand()) is None
    for flows in (x, y):
        flows.start()
    try:
        # x's own request frees the pod: x wakes first, yet b (served 0) goes before a (500), in y.
        ledger_x.finish(busy)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
    finally:
        for flows in (x, y):
            await flows.stop()
    # b0 (0 → 300), b1 (300 → 600), then a: b's counter passed a's 500 only after its second request.
    assert order == ["b0", "b1", "a0", "a1", "a2"]


async def test_a_wake_up_reaches_the_sibling_worker_as_one_datagram(run_dir):
    identities = [WorkerIdentity("r", i, 2, run_dir) for i in range(2)]
    config = SharedStateConfig(flush_ms=1000.0)  # nothing batched would go out within the test
    buses = [StateBus(config, identity, CollectorRegistry()) for identity in identities]
    rung = asyncio.Event()
    buses[1].on((RoomFreed,), lambda origin, fact: rung.set())
    for bus in buses:
        await bus.start()
    try:
        buses[0].tell_siblings(RoomFreed())
        await asyncio.wait_for(rung.wait(), 1.0)
    finally:
        for bus in buses:
            await bus.stop()
