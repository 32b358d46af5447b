from __future__ import annotations

import time
from collections import Counter

import pytest

from gateway.config import HealthConfig, PodConfig
from gateway.core.errors import ErrorKind, GatewayError
from gateway.http_client import HttpClient
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import Estimate
from gateway.plugin_registry import PluginRegistry, UnknownPlugin
from gateway.pods.health import HealthChecker
from gateway.pods.registry import PodRegistry
from gateway.routing.policy import Pick, Policy, PolicyContext, PrefixMatch, RoutingRequest, WeightedScorer
from gateway.routing.router import Router


def registry(n: int = 3, model: str = "m") -> PodRegistry:
    pods = PodRegistry([PodConfig(url=f"http://p{i}:1", name=f"p{i}", models=[model]) for i in range(n)],
                       HealthConfig(ejection_base_s=10))
    for pod in pods.all():
        pod.healthy = True
    return pods


def policies() -> PluginRegistry:
    return PluginRegistry("gateway.policies", "routing policy")


def make_router(pods: PodRegistry, policy: str, options: dict | None = None,
                ledger: InFlightLedger | None = None) -> Router:
    return Router(pods, policies(), policy, options or {}, PolicyContext.standalone(pods, ledger=ledger))


def request(model: str = "m") -> RoutingRequest:
    return RoutingRequest("r", model, "chat")


class SlowScorer:
    name = "slow"

    def score(self, request: RoutingRequest, pods: list) -> list[float]:
        time.sleep(0.02)
        return [0.0] * len(pods)


class FirstPicker:
    name = "first"

    def pick(self, request: RoutingRequest, pods: list, scores: list[float]) -> Pick:
        return Pick(pods[0], "first")


def test_the_router_times_each_part_by_kind_and_name():
    """A part measures nothing itself: the router records each call of each part, so a slow scorer shows."""
    pods = registry()
    context = PolicyContext.standalone(pods)
    router = Router(pods, policies(), "round_robin", {}, context)
    policy = Policy("timed", FirstPicker(), scorers=[WeightedScorer(SlowScorer())])
    router.route(request(), policy)
    router.route(request(), policy)

    def sample(kind: str, plugin: str, suffix: str) -> float | None:
        return context.metrics.registry.get_sample_value(f"gateway_routing_plugin_seconds_{suffix}",
                                                         {"kind": kind, "plugin": plugin})

    assert sample("scorer", "slow", "count") == 2
    assert sample("scorer", "slow", "sum") >= 0.04
    assert sample("picker", "first", "count") == 2
    assert sample("picker", "first", "sum") < 0.02


def test_policies_are_found_through_entry_points():
    plugins = policies()
    assert {"random", "round_robin", "least_request"} <= set(plugins.names())
    with pytest.raises(UnknownPlugin, match=r"known: .*least_request"):
        plugins.load("nope")


def test_unknown_default_policy_fails_at_start():
    with pytest.raises(UnknownPlugin):
        make_router(registry(), "nope")


def test_round_robin_skips_excluded_and_unhealthy():
    pods = registry(3)
    router = make_router(pods, "round_robin")
    policy = router.resolve(None)
    pods.get("p1").healthy = False
    chosen = [router.route(request(), policy).pod.name for _ in range(4)]
    assert chosen == ["p0", "p2", "p0", "p2"]
    decision = router.route(request(), policy, exclude=frozenset({"p0"}))
    assert decision.pod.name == "p2" and decision.reason == "rotation"


def test_least_request_scores_and_reason():
    pods = registry(3)
    ledger = InFlightLedger()
    for pod, running in (("p0", 4), ("p1", 1), ("p2", 2)):
        for i in range(running):
            ledger.dispatch(f"{pod}-{i}", pod, 0.0, "chat")
    router = make_router(pods, "least_request", ledger=ledger)
    decision = router.route(request(), router.resolve(None))
    assert decision.pod.name == "p1" and decision.reason == "least_in_flight"
    assert decision.scores == {"p0": 0.25, "p1": 1.0, "p2": 0.5}


def test_random_policy_uses_every_pod():
    pods = registry(3)
    router = make_router(pods, "random", options={"random": {"seed": 7}})
    counts = Counter(router.route(request(), router.resolve(None)).pod.name for _ in range(300))
    assert set(counts) == {"p0", "p1", "p2"} and min(counts.values()) > 60


def test_no_candidates_is_503_and_unknown_override_is_400():
    pods = registry(2)
    router = make_router(pods, "round_robin")
    with pytest.raises(GatewayError) as info:
        router.route(request("other-model"), router.resolve(None))
    assert info.value.kind is ErrorKind.NO_POD
    with pytest.raises(GatewayError) as info:
        router.resolve("nope")
    assert info.value.kind is ErrorKind.INVALID_REQUEST and info.value.param == "x-routing-strategy"


class FakeClock:
    """A monotonic clock that starts where a freshly booted host's does: near zero."""

    def __init__(self, now: float = 3.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_passive_ejection_backoff_doubles_per_ejection_and_success_resets():
    clock = FakeClock()
    pods = PodRegistry([PodConfig(url="http://p0:1", name="p0", models=["m"])],
                       HealthConfig(ejection_base_s=10, ejection_max_s=30), clock=clock)
    pod = pods.get("p0")
    pod.healthy = True
    pods.report_connect_failure(pod, "refused")
    assert pod.ejected_until == clock.now + 10 and pods.candidates("m") == []
    for _ in range(20):  # the rest of a burst sent before the ejection: the same outage, no longer
        pods.report_connect_failure(pod, "refused")
    assert pod.ejections == 1 and pod.ejected_until == clock.now + 10
    clock.now += 10  # back in rotation; its next request fails too: a second ejection in a row
    assert pods.candidates("m") == [pod]
    pods.report_connect_failure(pod, "refused")
    assert pod.ejections == 2 and pod.ejected_until == clock.now + 20
    clock.now += 20
    pods.report_connect_failure(pod, "refused")
    assert pod.ejected_until == clock.now + 30  # capped at ejection_max_s
    pods.report_success(pod)
    assert pods.candidates("m") == [pod] and pod.ejections == 0


def test_a_passing_health_probe_ends_an_ejection_that_began_before_it():
    clock = FakeClock()
    pods = PodRegistry([PodConfig(url="http://p0:1", name="p0", models=["m"])], HealthConfig(ejection_base_s=10),
                       clock=clock)
    pod = pods.get("p0")
    pod.healthy = True
    pods.report_connect_failure(pod, "refused")
    pods.health_passed(pod, probe_started=clock.now)  # sent as the pod was ejected: proves nothing
    assert pods.candidates("m") == []
    clock.now += 0.5
    pods.health_passed(pod, probe_started=clock.now)  # sent after: the pod answers again
    assert pods.candidates("m") == [pod] and pod.ejections == 0 and pod.ejected_at is None


def test_health_thresholds():
    pods = registry(1)
    pod = pods.get("p0")
    changes = []
    checker = HealthChecker(pods, http=HttpClient(), config=HealthConfig(failure_threshold=3, success_threshold=2),
                            on_change=changes.append)
    for _ in range(2):
        checker._record(pod, False, "down", initial=False)
    assert pod.healthy  # two failures are below the threshold
    checker._record(pod, False, "down", initial=False)
    assert not pod.healthy and changes == [pod]
    checker._record(pod, True, None, initial=False)
    assert not pod.healthy
    checker._record(pod, False, "down", initial=False)
    checker._record(pod, True, None, initial=False)
    checker._record(pod, True, None, initial=False)
    assert pod.healthy and len(changes) == 2


def test_model_union_keeps_lora_adapters():
    pods = registry(2)
    pods.get("p0").set_models([{"id": "base"}, {"id": "lora-a", "parent": "base"}])
    pods.get("p1").set_models([{"id": "base"}, {"id": "lora-b", "parent": "base"}])
    assert [c["id"] for c in pods.model_cards()] == ["base", "lora-a", "lora-b"]
    assert pods.knows_model("lora-b") and not pods.knows_model("m")


def test_prefix_cache_follows_the_gateways_own_routing_history_unless_the_pod_is_overloaded():
    pods, ledger, approximate = registry(3), InFlightLedger(), ApproximatePrefixIndex()
    router = Router(pods, policies(), "prefix_cache", {},
                    PolicyContext.standalone(pods, ledger=ledger, approximate=approximate))
    policy = router.resolve(None)
    shared = "\x1esystem\x1fYou review pull requests for a large Python codebase. " * 12

    def asking(question: str) -> RoutingRequest:
        return RoutingRequest("r", "m", "chat", prefix=PrefixMatch(False, text=f"{shared}\x1euser\x1f{question}"))

    ledger.dispatch("elsewhere", "p0", 0.0, "chat")
    first = router.route(asking("first"), policy)  # nothing sent yet: the least loaded of the idle pods
    assert first.pod.name in {"p1", "p2"} and first.scores[first.pod.name] > first.scores["p0"]
    approximate.record(f"{shared}\x1euser\x1ffirst", "p2")  # what the pipeline records once it is routed
    second = router.route(asking("second"), policy)
    assert (second.pod.name, second.reason) == ("p2", "approximate")
    assert second.scores["p2"] > max(second.scores["p0"], second.scores["p1"])
    for i in range(10):  # p2 past the overload guard (slack 8 over the least loaded): the prefix loses it
        ledger.dispatch(f"busy-{i}", "p2", 0.0, "chat")
    request = asking("third")
    third = router.route(request, policy)
    assert third.pod.name == "p1" and third.reason == "rebalanced"
    assert request.filtered_out == {"overload_guard": ["p2"]}


def test_throughput_takes_the_pod_with_the_most_requests_per_second_left_that_fits():
    pods, ledger = registry(3), InFlightLedger()
    ledger.dispatch("half", "p1", 0.5, "chat")
    router = make_router(pods, "throughput", ledger=ledger)
    policy = router.resolve(None)

    def sized(**estimates: Estimate) -> RoutingRequest:
        return RoutingRequest("r", "m", "chat", estimates=estimates)

    # requests/s left: p0 (1/0.25)/1.0 = 4, p1 4 x (1 - 0.5) = 2, p2 (1/0.6)/1.0 = 1.67
    estimates = {"p0": Estimate(0.25, e2e_s=1.0), "p1": Estimate(0.25, e2e_s=1.0), "p2": Estimate(0.6, e2e_s=1.0)}
    first = router.route(sized(**estimates), policy)
    assert (first.pod.name, first.reason) == ("p0", "most_headroom")
    assert first.scores == pytest.approx({"p0": 1.0, "p1": 0.5, "p2": 0.4167}, abs=1e-3)
    ledger.dispatch("full", "p0", 0.9, "chat")  # p0 cannot take 0.25 more: the capacity filter drops it
    request = sized(**estimates)
    second = router.route(request, policy)
    assert second.pod.name == "p1" and request.filtered_out == {"capacity": ["p0"]}
    # No pod fits: all stay candidates (the request was admitted), the most headroom still wins.
    too_big = {name: Estimate(1.5, e2e_s=1.0) for name in ("p0", "p1", "p2")}
    request = sized(**too_big)
    assert router.route(request, policy).pod.name == "p2" and request.filtered_out == {}
