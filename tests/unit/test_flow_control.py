"""Flow control's decisions: which flow a request belongs to, when it is held, and which held request the
controller lets go first (the highest band, then the least-served flow, then the earliest deadline)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.background import Doorbell
from gateway.config import (
    ApiKeyConfig,
    FlowControlConfig,
    HealthConfig,
    ObjectiveConfig,
    PodConfig,
    SaturationConfig,
    TenantConfig,
)
from gateway.core.errors import ErrorKind, GatewayError
from gateway.flow import controller as controller_module
from gateway.flow.controller import FlowController
from gateway.flow.flows import ENGINE_BAND_SPAN, Flow, FlowKey, FlowPolicy, engine_priority
from gateway.flow.metrics import FlowLabels, FlowMetrics
from gateway.flow.saturation import Demand, SaturationDetector
from gateway.flow.service_counters import ServiceCounters
from gateway.load.ledger import Dispatch, InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.load.slo_profiles import ProfileStore
from gateway.metrics import capped
from gateway.pods.registry import PodRegistry

MODEL = "mock-llama"
CONFIG = FlowControlConfig(
    objectives={"interactive": ObjectiveConfig(priority=5, ttft_ms=500, weight=2.0)},
    tenants={"team-a": TenantConfig(weight=3.0, max_wait_s=10.0)}, keys={"ci-key": "batch"})


def test_the_fairness_header_wins_then_the_workflow_then_the_key_tenant_then_default():
    policy = FlowPolicy(CONFIG)
    inherited = FlowKey("wf-tenant", 7)
    assert policy.resolve({"x-gateway-inference-fairness-id": "team-a"}, "ci-key", inherited).key \
        == FlowKey("team-a", 7)
    assert policy.resolve({}, "ci-key", inherited).key == FlowKey("wf-tenant", 7)
    assert policy.resolve({}, "ci-key", None).key == FlowKey("batch", 0)  # the key's configured tenant
    assert policy.resolve({}, "other-key", None).key == FlowKey("other-key", 0)  # a named key is its own
    assert policy.resolve({}, None, None).key == FlowKey("default", 0)


def test_a_named_objective_sets_band_weight_and_ttft_and_an_unknown_one_counts_as_none():
    policy = FlowPolicy(CONFIG)
    flow = policy.resolve({"x-gateway-inference-fairness-id": "team-a",
                           "x-gateway-inference-objective": "interactive", "x-priority": "1"}, None, None)
    assert flow.key == FlowKey("team-a", 5) and flow.objective == "interactive"
    assert flow.weight == 6.0 and flow.ttft_s == 0.5 and flow.max_wait_s == 10.0
    unknown = policy.resolve({"x-gateway-inference-objective": "nope", "x-priority": "2"}, None, None)
    assert unknown.key == FlowKey("default", 2) and unknown.objective is None and unknown.max_wait_s == 120.0


def test_the_engine_priority_puts_the_band_first_then_the_least_served_flow():
    counters = ServiceCounters()
    counters.charge(FlowKey("a"), 9_000.0)
    counters.charge(FlowKey("b"), 1_000.0)  # b has been served 8,000 weighted tokens less than a
    assert counters.tag(FlowKey("a")) == 9_000.0 and counters.tag(FlowKey("b")) == 1_000.0
    # A flow not served lately banks nothing: its tag is the least of its band's, not its own 0 (or, given a
    # credit, that less the credit).
    assert counters.tag(FlowKey("new")) == 1_000.0 and counters.tag(FlowKey("new"), credit=400.0) == 600.0
    assert counters.tag(FlowKey("b"), credit=400.0) == 1_000.0  # served lately: its own counter
    # vLLM serves lower values first: b before a, a higher band before both whatever its service.
    a, b = (engine_priority(0, counters.tag(FlowKey(f))) for f in "ab")
    assert b == 1_000 < a == 9_000 and engine_priority(5, 10 ** 15) == -5 * ENGINE_BAND_SPAN + ENGINE_BAND_SPAN - 1 < b
    assert engine_priority(-(10 ** 18), 0) == (1 << 63) - 1  # within vLLM's int64
    counters.charge(FlowKey("c", 5), 50_000.0)  # another band's service is not band 0's floor
    assert counters.tag(FlowKey("d", 5)) == 50_000.0 and counters.tag(FlowKey("new")) == 1_000.0


@pytest.mark.parametrize("headers", [{"x-gateway-inference-fairness-id": " "},
                                     {"x-gateway-inference-fairness-id": "x" * 129}, {"x-priority": "high"}])
def test_bad_flow_headers_are_a_400(headers):
    with pytest.raises(GatewayError) as error:
        FlowPolicy(CONFIG).resolve(headers, None, None)
    assert error.value.kind is ErrorKind.INVALID_REQUEST


def one_pod() -> PodRegistry:
    registry = PodRegistry([PodConfig(url="http://p0:1", name="p0", models=[MODEL])], HealthConfig())
    for pod in registry.all():
        pod.healthy = True
    return registry


def controller(ledger: InFlightLedger, counters: ServiceCounters, registry: PodRegistry | None = None,
               lift_credit: float = FlowControlConfig.lift_credit) -> FlowController:
    registry = registry or one_pod()
    config = FlowControlConfig(saturation=SaturationConfig(in_flight=1), max_wait_s=30, lift_credit=lift_credit)
    detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str), False)
    return FlowController(config, registry, detector, counters, Doorbell(), FlowMetrics(CollectorRegistry()))


async def take_turn(flows: FlowController, ledger: InFlightLedger, counters: ServiceCounters, order: list[str],
                    name: str, flow: Flow, charge: float = 0.0) -> None:
    """Wait to be released, then go as the flow-control step sends a request: charged ``charge``, dispatched
    (the pod full again), ended soon after."""
    release = await flows.hold(flow, MODEL, None, Demand(), 30.0)
    order.append(name)
    assert release.room == frozenset({"p0"}) and release.waited_s >= 0
    counters.charge(flow.key, charge)
    entry = ledger.dispatch(name, "p0", 1.0, "chat")
    flows.landed(release.held)
    await asyncio.sleep(0.01)
    ledger.finish(entry)


async def release_all(flows: FlowController, ledger: InFlightLedger, busy: Dispatch, tasks: list[asyncio.Task[None]]
                      ) -> None:
    """Free the pod ``busy`` filled and let every held request go, one at a time."""
    flows.start()
    try:
        ledger.finish(busy)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
    finally:
        await flows.stop()


async def test_an_idle_fleet_holds_nothing_and_a_saturated_one_releases_the_highest_band_then_the_least_served():
    ledger, counters = InFlightLedger(), ServiceCounters()
    registry = one_pod()
    flows = controller(ledger, counters, registry, lift_credit=0.0)  # the Virtual Token Counter's own lift
    pods = registry.candidates(MODEL)
    assert flows.room_now(pods, Demand()) == frozenset({"p0"})  # work-conserving
    busy = ledger.dispatch("busy", "p0", 1.0, "chat")  # the pod is full (in_flight=1)
    assert flows.room_now(pods, Demand()) is None

    counters.charge(FlowKey("a"), 500.0)  # a has been served much more than b
    order: list[str] = []

    def wait(name: str, key: FlowKey) -> asyncio.Task[None]:
        return asyncio.create_task(take_turn(flows, ledger, counters, order, name, Flow(key)))

    tasks = [wait("a1", FlowKey("a")), wait("a2", FlowKey("a"))]
    await asyncio.sleep(0)
    tasks.append(wait("b1", FlowKey("b")))
    await asyncio.sleep(0)
    tasks.append(wait("urgent", FlowKey("c", 9)))
    await asyncio.sleep(0.01)
    assert flows.queued == 4 and order == []
    # b started waiting after a: lifted to a's counter, never below it (no banked service).
    assert counters.get(FlowKey("b")) == 500.0
    await release_all(flows, ledger, busy, tasks)
    assert order[0] == "urgent"  # the highest band first
    assert order[1:] in (["a1", "b1", "a2"], ["b1", "a1", "a2"])  # equal service: the flows take turns
    assert flows.queued == 0


@pytest.mark.parametrize("lift_credit", [4096.0, 0.0])
async def test_a_flow_that_kept_up_takes_up_to_its_credit_before_the_flows_that_waited_all_along(lift_credit):
    # a floods with long prompts (3,700 weighted tokens each) and has been served 100,000; b kept up (it was
    # served 2,000) and now has eight short requests (1,000 each) at once, as a chatting tenant's come back.
    ledger, counters = InFlightLedger(), ServiceCounters()
    flows = controller(ledger, counters, lift_credit=lift_credit)
    counters.charge(FlowKey("a"), 100_000.0)
    counters.charge(FlowKey("b"), 2_000.0)
    busy = ledger.dispatch("busy", "p0", 1.0, "chat")
    order: list[str] = []

    def wait(name: str, charge: float) -> asyncio.Task[None]:
        return asyncio.create_task(take_turn(flows, ledger, counters, order, name, Flow(FlowKey(name[0])), charge))

    tasks = [wait(f"a{i}", 3_700.0) for i in range(3)]
    await asyncio.sleep(0)
    tasks += [wait(f"b{i}", 1_000.0) for i in range(8)]
    await asyncio.sleep(0.01)
    # b started to wait after a: lifted short of a's counter by the credit, never above it.
    assert counters.get(FlowKey("b")) == 100_000.0 - lift_credit
    await release_all(flows, ledger, busy, tasks)
    if lift_credit:
        # b's first five go before a's next (95,904 → 100,904); then the flows take turns by their counters.
        assert order == ["b0", "b1", "b2", "b3", "b4", "a0", "b5", "b6", "b7", "a1", "a2"], order
    else:
        # Level with a, b waits for a's next long prompt first (a tie: the flow that waited longer goes).
        assert order == ["a0", "b0", "b1", "b2", "b3", "a1", "b4", "b5", "b6", "b7", "a2"], order


async def test_a_client_that_leaves_while_held_leaves_no_trace_and_a_timeout_is_a_429():
    ledger, counters = InFlightLedger(), ServiceCounters()
    flows = controller(ledger, counters)
    ledger.dispatch("busy", "p0", 1.0, "chat")
    gone = asyncio.create_task(flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(), 30.0))
    await asyncio.sleep(0.01)
    assert flows.queued == 1
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert flows.queued == 0 and counters.get(FlowKey("a")) == 0.0
    with pytest.raises(GatewayError) as refused:
        await flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(), 0.02)
    assert refused.value.kind is ErrorKind.RATE_LIMITED and refused.value.code == "queue_timeout"
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    assert flows.queued == 0


def test_counters_of_idle_flows_are_forgotten_as_the_sweeps_see_them():
    now = [0.0]
    counters = ServiceCounters(idle_s=600.0, clock=lambda: now[0])
    counters.charge(FlowKey("a"), 10.0)
    counters.charge(FlowKey("waiting"), 10.0)
    assert counters.forget_idle(lambda key: False) == 0  # dated now, by this sweep
    now[0] = 650.0
    counters.charge(FlowKey("b"), 5.0)  # heard of since: dated by the next sweep
    now[0] = 700.0
    assert counters.forget_idle(lambda key: key == FlowKey("waiting")) == 1
    assert counters.get(FlowKey("a")) == 0.0 and counters.get(FlowKey("b")) == 5.0
    assert counters.get(FlowKey("waiting")) == 10.0


async def test_a_held_request_says_which_pods_it_may_go_to():
    # Keep-warm leaves a pod's capacity to a request held for it: one of its model's pods, not another's.
    ledger, counters = InFlightLedger(), ServiceCounters()
    registry = PodRegistry([PodConfig(url="http://p0:1", name="p0", models=[MODEL]),
                            PodConfig(url="http://p1:1", name="p1", models=["other"])], HealthConfig())
    for pod in registry.all():
        pod.healthy = True
    flows = controller(ledger, counters, registry)
    assert not flows.waits_for("p0") and not flows.waits_for("p1")
    ledger.dispatch("busy", "p0", 1.0, "chat")
    held = asyncio.create_task(flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(), 30.0))
    await asyncio.sleep(0.01)
    assert flows.waits_for("p0") and not flows.waits_for("p1")
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert not flows.waits_for("p0")


def test_a_request_goes_at_once_when_one_candidate_has_room_looking_no_further_than_it():
    ledger, counters = InFlightLedger(), ServiceCounters()
    registry = PodRegistry([PodConfig(url=f"http://p{i}:1", name=f"p{i}", models=[MODEL]) for i in range(50)],
                           HealthConfig())
    for pod in registry.all():
        pod.healthy = True
    flows = controller(ledger, counters, registry)
    pods = registry.candidates(MODEL)
    looked: list[str] = []
    saturated_by = flows.detector.saturated_by
    flows.detector.saturated_by = lambda pod, demand: looked.append(pod) or saturated_by(pod, demand)
    for i in range(3):
        ledger.dispatch(f"r{i}", f"p{i}", 1.0, "chat")  # the first three are full (in_flight=1)
    assert flows.goes_now(pods, Demand()) and looked == ["p0", "p1", "p2", "p3"]
    for i in range(3, 50):
        ledger.dispatch(f"r{i}", f"p{i}", 1.0, "chat")
    assert not flows.goes_now(pods, Demand()) and flows.room_now(pods, Demand()) is None


async def test_a_held_client_that_leaves_in_the_turn_its_room_frees_is_passed_over_for_the_next():
    # The client's task is cancelled (its future at once, its handler a turn later) in the same turn as
    # another request is dispatched and room frees: the release must skip the one gone, not fail on it.
    ledger, counters = InFlightLedger(), ServiceCounters()
    config = FlowControlConfig(saturation=SaturationConfig(in_flight=2), max_wait_s=30)
    detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str), False)
    flows = FlowController(config, one_pod(), detector, counters, Doorbell(), FlowMetrics(CollectorRegistry()))
    busy = [ledger.dispatch(f"busy{i}", "p0", 1.0, "chat") for i in range(2)]
    first = asyncio.create_task(flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(), 30.0))
    await asyncio.sleep(0)
    gone = asyncio.create_task(flows.hold(Flow(FlowKey("b")), MODEL, None, Demand(), 30.0))
    await asyncio.sleep(0)
    after = asyncio.create_task(flows.hold(Flow(FlowKey("c")), MODEL, None, Demand(), 30.0))
    await asyncio.sleep(0.01)
    flows.start()
    try:
        ledger.finish(busy[0])
        release = await asyncio.wait_for(first, 1)  # released at the loop's next tick
        ledger.finish(busy[1])
        gone.cancel()
        ledger.dispatch("first", "p0", 1.0, "chat")
        flows.landed(release.held)  # the next may go: the one gone is passed over, the one after it goes
        assert (await asyncio.wait_for(after, 1)).room == frozenset({"p0"})
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert flows.queued == 0
    finally:
        await flows.stop()


async def test_flows_idle_long_are_forgotten_though_the_fleet_never_held_a_request(monkeypatch):
    # The sweep ran only while requests were held: a fleet never saturated kept every flow it had served,
    # so past max_flows a new tenant shared the overflow flow, and an old counter never went.
    monkeypatch.setattr(controller_module, "SWEEP_S", 0.01)
    now = [1_000.0]
    ledger, counters = InFlightLedger(), ServiceCounters(idle_s=600.0, clock=lambda: now[0])
    config = FlowControlConfig(max_flows=2)
    detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str), False)
    flows = FlowController(config, one_pod(), detector, counters, Doorbell(), FlowMetrics(CollectorRegistry()),
                           clock=lambda: now[0])
    for name in "ab":  # two tenants served at once, an hour ago
        counters.charge(flows.queues.key_of(FlowKey(name)), 100.0)
    assert flows.queues.key_of(FlowKey("c")) == FlowKey("overflow")
    flows.start()
    try:
        for _ in range(200):
            now[0] += 20.0
            await asyncio.sleep(0.01)
            if flows.queues.key_of(FlowKey("c")) == FlowKey("c"):
                break
        assert flows.queues.key_of(FlowKey("c")) == FlowKey("c") and counters.get(FlowKey("a")) == 0.0
        assert flows.queued == 0
    finally:
        await flows.stop()


def flow_series(registry: CollectorRegistry, family: str) -> dict[tuple[str, str], float]:
    """(fairness_id, priority) → value summed over the family's other labels."""
    found: dict[tuple[str, str], float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == family:
                labels = (sample.labels["fairness_id"], sample.labels["priority"])
                found[labels] = found.get(labels, 0) + sample.value
    return found


def test_flow_series_are_the_configs_tenants_and_bands_and_one_other():
    # A client picks its fairness id and band by header: the series stay the config's whatever it sends.
    config = [CONFIG]
    registry = CollectorRegistry()
    metrics = FlowMetrics(registry, FlowLabels(lambda: config[0], ["alice", "ci-key", ""]))
    named = [FlowKey("team-a", 5), FlowKey("batch", 0), FlowKey("alice", 5), FlowKey("default", 0)]
    invented = [FlowKey(f"tenant-{i}" + "x" * 120, 6 + i) for i in range(500)]  # bands 6 to 505
    for key in (*named, *invented, FlowKey("team-a", 7), FlowKey("ci-key", 5)):
        metrics.outcome(key, "at_once")
        metrics.served(key, 10, 5, 3)
        metrics.waited(key, 0.2)
        metrics.queued(key, 1)
    requests = flow_series(registry, "gateway_flow_requests_total")
    assert requests == {("team-a", "5"): 2, ("batch", "0"): 2, ("alice", "5"): 2, ("default", "0"): 2,
                        ("other", "other"): 2 * 500, ("team-a", "other"): 2,
                        ("other", "5"): 2}  # ci-key is batch's key, not a tenant
    assert flow_series(registry, "gateway_flow_queued")[("other", "other")] == 500
    assert flow_series(registry, "gateway_flow_wait_seconds_count").keys() == requests.keys()
    assert flow_series(registry, "gateway_flow_tokens_total")[("other", "other")] == 500 * 18
    for key in invented:
        metrics.queued(key, -1)
    assert flow_series(registry, "gateway_flow_queued")[("other", "other")] == 0  # still there, at 0
    # A reload that names tenants and a band: their requests are theirs from then on (a name capped).
    config[0] = FlowControlConfig(tenants={"tenant-3" + "x" * 120: TenantConfig(), "t" * 300: TenantConfig()},
                                  objectives={"low": ObjectiveConfig(priority=9)})
    metrics.outcome(invented[3], "at_once")
    metrics.outcome(FlowKey("t" * 300), "at_once")
    requests = flow_series(registry, "gateway_flow_requests_total")
    assert requests[("tenant-3" + "x" * 120, "9")] == 1 and requests[(capped("t" * 300), "0")] == 1


async def test_the_debug_page_gives_a_flows_oldest_wait_not_its_heads():
    # The head is the earliest deadline: a request with a tight SLO that came later goes first, but the
    # flow's oldest wait is the request that came first.
    now = [100.0]
    ledger, counters = InFlightLedger(), ServiceCounters()
    config = FlowControlConfig(saturation=SaturationConfig(in_flight=1))
    detector = SaturationDetector(config.saturation, ledger, PendingLoad(ProfileStore(None), ledger, 4, str), False)
    flows = FlowController(config, one_pod(), detector, counters, Doorbell(), FlowMetrics(CollectorRegistry()),
                           clock=lambda: now[0])
    ledger.dispatch("busy", "p0", 1.0, "chat")
    waiting = [asyncio.create_task(flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(), 30.0))]
    await asyncio.sleep(0)
    now[0] += 5.0
    waiting.append(asyncio.create_task(flows.hold(Flow(FlowKey("a")), MODEL, None, Demand(), 1.0)))
    await asyncio.sleep(0)
    now[0] += 0.5
    [flow] = flows.debug()["flows"]
    assert flow["queued"] == 2 and flow["oldest_wait_s"] == 5.5
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)

def test_a_keys_named_tenant_has_its_own_series_and_its_name_does_not():
    # auth.keys[].tenant: the key runs as that tenant (request/identity.py), so its series are the tenant's.
    keys = [ApiKeyConfig(hash="ab" * 32, name="bob-laptop", tenant="team-b"),
            ApiKeyConfig(hash="cd" * 32, name="carol")]
    registry = CollectorRegistry()
    metrics = FlowMetrics(registry, FlowLabels.of_keys(lambda: CONFIG, keys))
    for key in (FlowKey("team-b", 0), FlowKey("bob-laptop", 0), FlowKey("carol", 0)):
        metrics.outcome(key, "at_once")
    assert flow_series(registry, "gateway_flow_requests_total") == {("team-b", "0"): 1, ("other", "0"): 1,
                                                                    ("carol", "0"): 1}
