"""How much prefill work a pod has left, as the in-flight ledger counts it, and flow control sending the next
prompt as the running one drains: before its answer begins, so that the pod never idles between prompts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission import SloPolicy
from gateway.background import Doorbell
from gateway.config import AdmissionConfig, FlowControlConfig, SaturationConfig
from gateway.core.facts import ServiceCharged
from gateway.core.usage import Usage
from gateway.flow.controller import FlowController
from gateway.flow.flows import Flow, FlowKey
from gateway.flow.metrics import FlowMetrics
from gateway.flow.saturation import Demand, SaturationDetector
from gateway.flow.service_counters import ANNOUNCE_S, ServiceCounters, WorkflowFlows
from gateway.load.ledger import Dispatch, InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.shared_table import SharedLoadTable
from gateway.load.slo_profiles import ProfileStore
from gateway.proxy.outcome import Ending, RelayOutcome
from gateway.request.flow_control import FlowControlStep
from gateway.request.types import Admitted
from tests.unit.test_flow_control import MODEL, one_pod
from tests.unit.test_pipeline import attempt_of, chat, client_request, policy, routing_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_running_prefill_counts_down_at_the_rate_the_pod_showed():
    clock = Clock()
    ledger = InFlightLedger(clock=clock)
    first = ledger.dispatch("a1", "p", 1.0, "chat", prefill_tokens=3700)  # the idle pod begins on it at once
    clock.now += 0.01
    ledger.dispatch("a2", "p", 1.0, "chat", prefill_tokens=3700)  # queued behind it
    assert ledger.prefill_rate("p") is None and ledger.prefill_remaining("p", clock.now + 5) == 7400  # no rate yet
    clock.now += 0.09
    ledger.answering(first)  # 3,700 tokens in 0.1 s
    assert ledger.prefill_rate("p") == pytest.approx(37_000)
    assert ledger.prefill_remaining("p", clock.now) == 3700
    assert ledger.prefill_remaining("p", clock.now + 0.05) == pytest.approx(1850)
    # Below 2,048 tokens after (3,700 - 2,048) / 37,000 s: when flow control looks again.
    assert ledger.prefill_below_in("p", 2048, clock.now) == pytest.approx(1652 / 37_000 + 1e-3)
    assert ledger.prefill_below_in("p", 2048, clock.now + 0.05) == 0.0


def test_a_stalled_pod_is_not_counted_down_past_what_it_had_when_it_last_made_progress():
    clock = Clock()
    ledger = InFlightLedger(clock=clock)
    first = ledger.dispatch("a1", "p", 1.0, "chat", prefill_tokens=3700)
    clock.now += 0.1
    ledger.answering(first)
    ledger.dispatch("a2", "p", 1.0, "chat", prefill_tokens=3700)
    clock.now += 10.0  # no answer for long: the rate would have got through it long ago
    assert ledger.prefill_remaining("p", clock.now) == 0.0
    ledger.dispatch("a3", "p", 1.0, "chat", prefill_tokens=3700)  # sent after that: counted whole
    assert ledger.prefill_remaining("p", clock.now) == 3700
    assert ledger.prefill_below_in("p", 2048, clock.now) is None  # only an answer beginning can free it


def test_workers_read_the_latest_progress_any_of_them_saw(tmp_path: Path):
    path = str(tmp_path / "table")
    SharedLoadTable.create(path, 2).close()
    clock = Clock()
    w0, w1 = (InFlightLedger(SharedLoadTable(path, i, 2), clock=clock) for i in range(2))
    for ledger in (w0, w1):  # each measures the rate from its own answers
        entry = ledger.dispatch("warm", "p", 1.0, "chat", prefill_tokens=1000)
        clock.now += 0.1
        ledger.answering(entry)
        ledger.finish(entry)
    clock.now += 5.0
    a1 = w0.dispatch("a1", "p", 1.0, "chat", prefill_tokens=3000)  # the idle pod begins on w0's prompt
    clock.now += 0.01
    w1.dispatch("a2", "p", 1.0, "chat", prefill_tokens=3000)  # w1's waits behind it: not a beginning
    assert w1.prefill_remaining("p", clock.now) == pytest.approx(6000 - 0.01 * 10_000)
    clock.now += 0.29
    w0.answering(a1)  # w1 reads that its prompt began now
    assert w1.prefill_remaining("p", clock.now) == 3000
    assert w1.prefill_remaining("p", clock.now + 0.1) == pytest.approx(2000)


async def test_flow_control_sends_the_next_prompt_before_the_running_one_answers():
    ledger = InFlightLedger()
    config = FlowControlConfig(saturation=SaturationConfig(prefill_tokens=2048), max_wait_s=30)
    detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str), False)
    flows = FlowController(config, one_pod(), detector, ServiceCounters(), Doorbell(), FlowMetrics(CollectorRegistry()))
    warm = ledger.dispatch("warm", "p0", 1.0, "chat", prefill_tokens=2000)
    await asyncio.sleep(0.02)
    ledger.answering(warm)  # the pod's rate: about 100,000 tokens a second
    ledger.finish(warm)
    rate = ledger.prefill_rate("p0")
    assert rate is not None
    running = ledger.dispatch("running", "p0", 1.0, "chat", prefill_tokens=int(2048 + 0.15 * rate))
    sent = time.monotonic()
    assert detector.saturated_by("p0") == "prefill"
    flows.start()
    try:
        release = await asyncio.wait_for(flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(), 30.0), 5)
    finally:
        await flows.stop()
    waited = time.monotonic() - sent
    # Released once the running prefill was predicted below 2,048 tokens (after 0.15 s), without its answer
    # beginning (none came: without the count-down it would wait until its limit).
    assert release.room == frozenset({"p0"}) and 0.14 <= waited < 1.0, waited
    assert ledger.prefill_backlog("p0") == running.prefill_tokens


def test_flows_served_lately_are_counted_over_two_windows():
    counters = ServiceCounters()
    assert counters.active_flows(100.0) == 0
    counters.charge(FlowKey("a"), 10.0)
    counters.charge(FlowKey("b"), 10.0)
    assert counters.active_flows(100.5) == 2
    assert counters.active_flows(102.1) == 2  # a new window: the last one's flows still count
    counters.charge(FlowKey("a"), 10.0)
    assert counters.active_flows(104.2) == 1  # b was last charged two windows ago
    assert counters.active_flows(110.0) == 0  # long quiet: nothing is active


def test_a_flow_with_an_answer_under_way_is_served_however_long_the_answer_takes():
    counters = ServiceCounters()
    a, b = FlowKey("a"), FlowKey("b")
    counters.active_flows(100.0)
    counters.charge(b, 10.0)
    counters.answering(b)
    counters.answering(b)  # two of b's requests are answered
    assert counters.active_flows(102.1) == 1
    counters.charge(a, 10.0)
    assert counters.active_flows(104.2) == 2  # b was charged two windows ago, but its answers are under way
    counters.answered(b)
    assert counters.active_flows(104.3) == 2
    counters.answered(b)
    assert counters.active_flows(104.4) == 1
    assert counters.active_flows(106.5) == 0


def test_while_another_flows_answer_is_under_way_a_long_prompt_waits_for_the_queue_not_the_count_down():
    """Issue 56: on vLLM 5x slower, B's 16-token answers beside a documents flood took 3-5 s, past the window of
    flows served lately; between two of its requests the count-down sent A's next document early, and B's next
    request waited for the rest of one document and all of the next (B's p90 1.64 floors)."""
    clock, ledger, counters, detector = detector_on_one_pod(join_beside_prefill=False)
    a, b = FlowKey("a"), FlowKey("b")
    counters.active_flows(clock.now)
    counters.charge(b, 1.0)
    counters.answering(b)  # b's answer, slow to end
    first = ledger.dispatch("a1", "p", 1.0, "chat", prefill_tokens=3700)
    clock.now += 0.1
    ledger.answering(first)  # 37,000 tokens a second
    ledger.dispatch("a2", "p", 1.0, "chat", prefill_tokens=3700)
    counters.charge(a, 1.0)
    clock.now += 2.1
    counters.active_flows(clock.now)
    counters.charge(a, 1.0)
    clock.now += 2.1  # a2 long counted down, b last charged two windows ago
    long = Demand(prompt_tokens=3700, held=True)
    assert detector.saturated_by("p", long) == "prefill"  # a3 waits for a2's answer to begin
    counters.answered(b)
    assert detector.saturated_by("p", long) is None  # a alone: the count-down keeps the steps full


async def test_the_flows_answered_here_are_announced_to_the_other_workers_while_their_answers_last():
    """Worker 1 answers b (slowly) and c; worker 2 floods with a. Worker 2 hears every ``ANNOUNCE_S`` that two
    flows are answered there (no more: more than one is what its count-down reads), and stops hearing once
    the answers end."""
    facts: list[ServiceCharged] = []
    here = ServiceCounters(facts.append)
    there = ServiceCounters()
    config = FlowControlConfig(saturation=SaturationConfig(prefill_tokens=2048))
    ledger = InFlightLedger()
    detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str), False,
                                  active_flows=here.active_flows)
    controller = FlowController(config, one_pod(), detector, here, Doorbell(), FlowMetrics(CollectorRegistry()))
    for flow in ("b", "c", "d"):
        here.answering(FlowKey(flow))
    controller.start()
    try:
        await asyncio.sleep(ANNOUNCE_S * 2.5)
        announced = [fact for fact in facts if fact.amount == 0.0]
        assert {f.fairness_id for f in announced} == {"b", "c"} and len(announced) in (4, 6), announced
        for fact in announced:
            there.apply_remote("worker-1", fact)
        there.charge(FlowKey("a"), 1.0)
        assert there.active_flows(time.monotonic()) == 3
        for flow in ("b", "c", "d"):
            here.answered(FlowKey(flow))
        facts.clear()
        await asyncio.sleep(ANNOUNCE_S * 1.5)
        assert facts == []
    finally:
        await controller.stop()


def test_the_flow_control_step_counts_a_flow_served_from_its_dispatch_to_the_end_of_its_attempt():
    ledger, counters, controller = several_flows(1.0)
    step = FlowControlStep(controller, SloPolicy(AdmissionConfig()), WorkflowFlows(), one_pod(),
                           FlowMetrics(CollectorRegistry()))
    request = client_request(chat(), headers={"x-gateway-inference-fairness-id": "b"})
    routing = routing_of(request, token_ids=list(range(200)))
    admitted = step.admit(request, policy(), routing)
    assert isinstance(admitted, Admitted) and admitted.flow == FlowKey("b")
    counters.active_flows(0.0)
    attempt = attempt_of(request, routing, "p0", one_pod(), ledger)
    step.dispatched(attempt)
    assert counters.active_flows(10.0) == 1 and counters.active_flows(20.0) == 1  # answering, windows on
    step.attempt_finished(attempt, RelayOutcome(200, Ending.COMPLETE, usage=Usage(prompt_tokens=200)))
    counters.active_flows(30.0)  # (the correction at its end may charge b once more)
    assert counters.active_flows(40.0) == 0


def detector_on_one_pod(join_beside_prefill: bool = True
                         ) -> tuple[Clock, InFlightLedger, ServiceCounters, SaturationDetector]:
    """A detector of 2,048-token steps over its own ledger, service counters and clock."""
    clock = Clock()
    ledger = InFlightLedger(clock=clock)
    counters = ServiceCounters()
    config = SaturationConfig(prefill_tokens=2048, join_beside_prefill=join_beside_prefill)
    detector = SaturationDetector(config, ledger,
                                  PendingLoad(ProfileStore(None), ledger, 4, str), False,
                                  active_flows=counters.active_flows, clock=clock)
    return clock, ledger, counters, detector


def test_the_count_down_runs_while_one_flow_is_served_and_with_several_a_held_prompt_that_fits_the_next_step_goes():
    clock, ledger, counters, detector = detector_on_one_pod()
    first = ledger.dispatch("a1", "p", 1.0, "chat", prefill_tokens=3700)
    clock.now += 0.1
    ledger.answering(first)  # 37,000 tokens a second
    ledger.dispatch("a2", "p", 1.0, "chat", prefill_tokens=3700)
    clock.now += 0.05  # 1,850 tokens left of a2: below the threshold by the count-down
    counters.charge(FlowKey("a"), 1.0)
    long, short, too_long = (Demand(prompt_tokens=n, held=True) for n in (3700, 150, 250))
    assert detector.saturated_by("p", long) is None and detector.prefill_room_in("p", long) == 0.0
    counters.charge(FlowKey("b"), 1.0)  # another tenant is served too: fairness goes first
    # a2's last chunk leaves room for 198 tokens in its step: a short held prompt rides there (it is routed among
    # the pods with room), a long one waits for an empty queue (an answer beginning), not for the count-down
    assert detector.saturated_by("p", short) is None
    assert detector.saturated_by("p", too_long) == "prefill" and detector.saturated_by("p", long) == "prefill"
    assert detector.prefill_room_in("p", long) is None
    assert detector.prefill_room_in("p", too_long) == pytest.approx((1850 - (2048 - 250)) / 37_000 + 1e-3)
    clock.now += 0.002  # 74 tokens later, 250 fit
    assert detector.saturated_by("p", too_long) is None
    # One that would go at once (routed among every pod) needs the queue itself to fit: a2 whole.
    assert detector.saturated_by("p", Demand(prompt_tokens=150)) == "prefill"
    assert detector.prefill_room_in("p", Demand(prompt_tokens=150)) is None


def test_a_held_short_prompt_is_released_as_soon_as_it_fits_beside_the_running_chunk_not_after_the_prefill():
    clock, ledger, counters, detector = detector_on_one_pod()
    warm = ledger.dispatch("warm", "p", 1.0, "chat", prefill_tokens=5000)
    clock.now += 0.5
    ledger.answering(warm)  # 10,000 tokens a second
    ledger.finish(warm)
    counters.charge(FlowKey("a"), 1.0)
    counters.charge(FlowKey("b"), 1.0)
    ledger.dispatch("a1", "p", 1.0, "chat", prefill_tokens=5700)  # the idle pod begins on a's long prompt
    b = Demand(prompt_tokens=200, held=True)
    assert detector.saturated_by("p", b) == "prefill"
    # b goes once a1's rest and b's prompt fit in one step: 3,852 tokens of a1 into its prefill (0.385 s), not
    # at a1's first token (0.57 s)
    assert detector.prefill_room_in("p", b) == pytest.approx(0.3852 + 1e-3)
    clock.now += 0.38
    assert detector.saturated_by("p", b) == "prefill"
    clock.now += 0.01
    assert detector.saturated_by("p", b) is None
    assert detector.saturated_by("p", Demand(prompt_tokens=3700, held=True)) == "prefill"  # a long one still waits


def test_without_joining_beside_the_prefill_a_held_short_prompt_waits_for_the_whole_queue():
    clock, ledger, counters, detector = detector_on_one_pod(join_beside_prefill=False)
    counters.charge(FlowKey("a"), 1.0)
    counters.charge(FlowKey("b"), 1.0)
    ledger.dispatch("a1", "p", 1.0, "chat", prefill_tokens=5700)
    b = Demand(prompt_tokens=200, held=True)
    assert detector.saturated_by("p", b) == "prefill" and detector.prefill_room_in("p", b) is None
    clock.now += 0.39  # where joining would have let it go
    assert detector.saturated_by("p", b) == "prefill"


def test_with_several_flows_a_long_prompt_joins_a_queue_only_where_it_fits_in_one_step_with_it():
    clock = Clock()
    ledger = InFlightLedger(clock=clock)
    counters = ServiceCounters()
    detector = SaturationDetector(SaturationConfig(prefill_tokens=2048), ledger,
                                  PendingLoad(ProfileStore(None), ledger, 4, str), False,
                                  active_flows=counters.active_flows, clock=clock)
    counters.charge(FlowKey("a"), 1.0)
    counters.charge(FlowKey("b"), 1.0)
    long, short = Demand(prompt_tokens=3700), Demand(prompt_tokens=200)
    assert detector.saturated_by("p", long) is None  # an empty queue takes any prompt
    b = ledger.dispatch("b1", "p", 1.0, "chat", prefill_tokens=200)  # b's short prompt is queued
    # a's long one would share b's first step (200 + 3,700 tokens past 2,048): it waits until b begins ...
    assert detector.saturated_by("p", long) == "prefill"
    assert detector.saturated_by("p", short) is None  # ... another short one fits in that step
    assert detector.saturated_by("p") is None  # the pod has room: only the long prompt is too large for it
    clock.now += 0.02
    ledger.answering(b)
    assert detector.saturated_by("p", long) is None
    # One flow alone: fairness is not at stake, and the count-down keeps the steps full.
    one = InFlightLedger(clock=clock)
    alone = SaturationDetector(SaturationConfig(prefill_tokens=2048), one,
                               PendingLoad(ProfileStore(None), one, 4, str), False, clock=clock)
    one.dispatch("a1", "p", 1.0, "chat", prefill_tokens=200)
    assert alone.saturated_by("p", long) is None


def several_flows(fit_wait_s: float) -> tuple[InFlightLedger, ServiceCounters, FlowController]:
    """One pod behind a flow controller that counts the flows served (the test charges them)."""
    ledger, counters = InFlightLedger(), ServiceCounters()
    config = FlowControlConfig(saturation=SaturationConfig(prefill_tokens=2048, prefill_fit_wait_s=fit_wait_s),
                               max_wait_s=30)
    detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str), False,
                                  active_flows=counters.active_flows)
    return ledger, counters, FlowController(config, one_pod(), detector, counters, Doorbell(),
                                            FlowMetrics(CollectorRegistry()))


class Clients:
    """Requests held by ``flows`` and sent to the pod as soon as released: in what order, and what was sent."""

    def __init__(self, flows: FlowController, ledger: InFlightLedger) -> None:
        self._flows = flows
        self._ledger = ledger
        self.order: list[str] = []
        self.sent: dict[str, Dispatch] = {}

    async def send(self, name: str, flow: str, tokens: int) -> None:
        release = await self._flows.hold(Flow(FlowKey(flow)), MODEL, None, Demand(prompt_tokens=tokens), 30.0)
        self.order.append(name)
        self.sent[name] = self._ledger.dispatch(name, "p0", 1.0, "chat", prefill_tokens=tokens)
        self._flows.landed(release.held)

    async def queue(self, *requests: tuple[str, str, int]) -> list[asyncio.Task[None]]:
        """Send each ``(name, flow, prompt tokens)`` in turn, each held before the next arrives."""
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(self.send(*request)))
            await asyncio.sleep(0)
        return tasks


async def test_flow_control_holds_a_long_prompt_until_the_short_one_released_before_it_begins():
    # Only an answer beginning releases a1 here, however slow the machine (the limit has its own test).
    ledger, counters, flows = several_flows(fit_wait_s=30)
    counters.charge(FlowKey("a"), 10_000.0)  # a has been served far more than b
    counters.charge(FlowKey("b"), 1.0)
    running = ledger.dispatch("a0", "p0", 1.0, "chat", prefill_tokens=3700)  # a's prompt is being prefilled
    clients = Clients(flows, ledger)
    tasks = await clients.queue(("b1", "b", 200), ("a1", "a", 3700))
    flows.start()
    try:
        await asyncio.sleep(0.1)
        assert clients.order == [] and flows.queued == 2  # a0's prefill fills the pod
        ledger.answering(running)
        await asyncio.sleep(0.1)
        # b, the least served, goes first; a1 would share b's first step, so it waits for b to begin.
        assert clients.order == ["b1"] and flows.queued == 1
        ledger.answering(clients.sent["b1"])
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
    finally:
        await flows.stop()
    assert clients.order == ["b1", "a1"]


async def test_a_long_prompt_that_waits_for_an_empty_queue_is_not_passed_by_shorter_ones_behind_it():
    # Only an answer beginning releases a1 here, however slow the machine (the limit has its own test).
    ledger, counters, flows = several_flows(fit_wait_s=30)
    counters.charge(FlowKey("a"), 1.0)  # a, the least served, goes first ...
    counters.charge(FlowKey("b"), 10_000.0)
    queued = ledger.dispatch("b0", "p0", 1.0, "chat", prefill_tokens=200)  # ... but a short prompt is queued
    clients = Clients(flows, ledger)
    tasks = await clients.queue(("a1", "a", 3700), ("b1", "b", 200))  # b1 would fit beside b0; a1 would not
    flows.start()
    try:
        await asyncio.sleep(0.1)
        assert clients.order == [] and flows.queued == 2  # b1 waits behind a1, which waits for b0 to begin
        seen = flows.debug()
        assert seen["pods"] == {"p0": "room"} and seen["prefill_queued"] == {"p0": 200}  # room, but not for a1
        ledger.answering(queued)
        await asyncio.sleep(0.1)
        assert clients.order == ["a1"]  # then b1 waits for a1's prefill
        ledger.answering(clients.sent["a1"])
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
    finally:
        await flows.stop()
    assert clients.order == ["a1", "b1"]


async def test_a_long_prompt_waits_for_a_queue_that_never_shows_its_start_no_longer_than_prefill_fit_wait_s():
    ledger, counters, flows = several_flows(fit_wait_s=0.2)
    counters.charge(FlowKey("a"), 1.0)
    counters.charge(FlowKey("b"), 1.0)
    # b's answer is not streamed: the gateway sees no first token, and its prompt stays queued until it ends.
    ledger.dispatch("b0", "p0", 1.0, "chat", prefill_tokens=200)
    flows.start()
    try:
        started = time.monotonic()
        release = await asyncio.wait_for(
            flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(prompt_tokens=3700), 30.0), 5)
        waited = time.monotonic() - started
    finally:
        await flows.stop()
    assert release.room == frozenset({"p0"}) and 0.2 <= waited < 0.5, waited
