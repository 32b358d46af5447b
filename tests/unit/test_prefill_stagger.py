"""While several flows are served, the pods' long prefills are staggered: a prompt longer than one step starts on a
pod only while another candidate pod has at most half as much prefill work left, so that another flow's newcomer
finds a pod about to take it (issue 54's crowd of documents: docs/flow-isolation.md#a-crowd-of-documents)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.background import Doorbell
from gateway.config import FlowControlConfig, HealthConfig, PodConfig, SaturationConfig
from gateway.flow.controller import FlowController
from gateway.flow.flows import Flow, FlowKey
from gateway.flow.metrics import FlowMetrics
from gateway.flow.saturation import Demand, SaturationDetector
from gateway.flow.service_counters import ServiceCounters
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.slo_profiles import ProfileStore
from gateway.pods.registry import PodRegistry
from tests.unit.test_flow_control import MODEL
from tests.unit.test_prefill_progress import Clock

DOC = Demand(prompt_tokens=6000, held=True)  # three steps of 2,048


def two_pods() -> PodRegistry:
    registry = PodRegistry([PodConfig(url=f"http://p{i}:1", name=f"p{i}", models=[MODEL]) for i in range(2)],
                           HealthConfig())
    for pod in registry.all():
        pod.healthy = True
    return registry


def fleet(stagger: bool = True, flows: int = 2) -> tuple[Clock, InFlightLedger, SaturationDetector, PodRegistry]:
    """Two pods; p0 has shown a rate of 10,000 prompt tokens a second and begins one of A's documents."""
    clock, counters = Clock(), ServiceCounters()
    ledger = InFlightLedger(clock=clock)
    detector = SaturationDetector(SaturationConfig(prefill_tokens=2048, stagger_prefills=stagger), ledger,
                                  PendingLoad(ProfileStore(None), ledger, 4, str), False,
                                  active_flows=counters.active_flows, clock=clock)
    for name in ("a", "b")[:flows]:
        counters.charge(FlowKey(name), 1.0)
    warm = ledger.dispatch("warm", "p0", 1.0, "chat", prefill_tokens=5000)
    clock.now += 0.5
    ledger.answering(warm)
    ledger.finish(warm)
    ledger.dispatch("a1", "p0", 1.0, "chat", prefill_tokens=6000)
    return clock, ledger, detector, two_pods()


def test_a_long_prompt_starts_on_the_idle_pod_only_once_the_other_is_halfway_through_its_own():
    clock, _, detector, registry = fleet()
    pods = registry.all()
    # p1 is idle, but starting a document there now would have both pods begin one together: a newcomer of
    # another flow would then wait for all of one, whichever pod it went to.
    assert detector.saturated_by("p1", DOC) is None and detector.room_among(pods, DOC) is None
    assert not detector.has_room(pods, DOC)
    assert detector.stagger_in(pods, DOC) == pytest.approx(0.3 + 1e-3)  # p0 down to 3,000 of its 6,000 tokens
    assert detector.prefill_room_among(pods, DOC) == pytest.approx(0.3 + 1e-3) == detector.stagger_only_in(pods, DOC)
    clock.now += 0.31
    assert detector.room_among(pods, DOC) == frozenset({"p1"}) and detector.has_room(pods, DOC)
    # A prompt of one step, or a short one, is never held for it.
    for short in (Demand(prompt_tokens=2048, held=True), Demand(prompt_tokens=100)):
        clock.now -= 0.31
        assert detector.room_among(pods, short) == frozenset({"p1"})
        clock.now += 0.31


@pytest.mark.parametrize("case", ["one flow", "one pod", "switched off"])
def test_nothing_is_staggered_for_one_flow_on_one_pod_or_when_switched_off(case: str):
    _, _, detector, registry = fleet(stagger=case != "switched off", flows=1 if case == "one flow" else 2)
    pods = registry.all()[1:] if case == "one pod" else registry.all()
    assert detector.room_among(pods, DOC) == frozenset({"p1"}) and detector.stagger_in(pods, DOC) is None


def test_two_idle_pods_take_a_long_prompt_each_and_a_pod_without_a_measured_rate_counts_as_near_its_turn():
    clock, ledger, detector, registry = fleet()
    pods = registry.all()
    ledger.dispatch("b1", "p1", 1.0, "chat", prefill_tokens=9000)  # p1 has no rate yet: not known to be busy long
    assert detector.room_among(pods, DOC) is None  # (both have a prefill to run: neither has room)
    fresh = InFlightLedger(clock=clock)
    idle = SaturationDetector(detector.config, fresh, PendingLoad(ProfileStore(None), fresh, 4, str), False,
                              active_flows=lambda now: 2, clock=clock)
    assert idle.room_among(pods, DOC) == frozenset({"p0", "p1"})  # either may start it: the other stays near


async def test_another_flows_short_request_passes_a_long_one_held_only_for_the_stagger():
    ledger = InFlightLedger()
    counters = ServiceCounters()
    config = FlowControlConfig(saturation=SaturationConfig(prefill_tokens=2048, prefill_fit_wait_s=30),
                               max_wait_s=30, lift_credit=0)
    detector = SaturationDetector(config.saturation, ledger,
                                  PendingLoad(ProfileStore(None), ledger, 4, str), False,
                                  active_flows=counters.active_flows)
    flows = FlowController(config, two_pods(), detector, counters, Doorbell(), FlowMetrics(CollectorRegistry()))
    counters.charge(FlowKey("a"), 1.0)  # a, the least served, comes first ...
    counters.charge(FlowKey("b"), 10_000.0)
    warm = ledger.dispatch("warm", "p0", 1.0, "chat", prefill_tokens=1000)
    await asyncio.sleep(0.01)
    ledger.answering(warm)  # about 100,000 tokens a second, less on a slow machine
    ledger.finish(warm)
    ledger.dispatch("a0", "p0", 1.0, "chat", prefill_tokens=10_000_000)  # ... p0 is busy for long
    a = asyncio.create_task(flows.hold(Flow(FlowKey("a")), MODEL, None, DOC, 30.0))
    b = asyncio.create_task(flows.hold(Flow(FlowKey("b")), MODEL, None, Demand(prompt_tokens=100, held=True), 30.0))
    flows.start()
    try:
        released = await asyncio.wait_for(b, 5)  # ... but b's chat goes to the idle pod meanwhile
        assert released.room == frozenset({"p1"}) and not a.done()
    finally:
        a.cancel()
        await flows.stop()
