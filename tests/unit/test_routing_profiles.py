"""Routing profiles declared in config: parts found by name, weights, the gateway's own filters."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, HealthConfig, PodConfig, load_config
from gateway.load.ledger import InFlightLedger
from gateway.plugin_registry import PluginOptionsError, PluginRegistry, UnknownPlugin
from gateway.pods.registry import PodRegistry
from gateway.routing.policy import PolicyContext, RoutingRequest
from gateway.routing.router import Router

DOCS = Path(__file__).resolve().parents[2] / "docs/routing.md"


def docs_example() -> str:
    """The worked example of docs/routing.md (prefer the H200 unless the A100 is much less busy), as written."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOCS.read_text(), flags=re.S | re.M)
    return next(b for b in blocks if "prefer_h200:" in b)


PREFER_H200 = docs_example()


def registry() -> PodRegistry:
    pods = PodRegistry([PodConfig(url="http://a:1", name="a100", models=["m"], deployment="a100"),
                        PodConfig(url="http://h:1", name="h200", models=["m"], deployment="h200")],
                       HealthConfig())
    for pod in pods.all():
        pod.healthy = True
    return pods


def router_for(text: str, pods: PodRegistry, ledger: InFlightLedger | None = None) -> Router:
    routing = load_config(overrides=yaml.safe_load(text)).routing
    return Router(pods, PluginRegistry("gateway.policies", "routing policy"), routing.policy, routing.options,
                  PolicyContext.standalone(pods, ledger=ledger), profiles=routing.profiles)


def busy(ledger: InFlightLedger, pod: str) -> None:
    """One more request in flight on ``pod``."""
    ledger.dispatch(f"{pod}-{ledger.on_pod(pod)}", pod, 0.1, "chat")


def test_a_scorer_declared_in_config_weighs_in_by_its_weight():
    pods, ledger = registry(), InFlightLedger()
    router = router_for(PREFER_H200, pods, ledger)
    policy = router.resolve(None)
    assert policy.name == "prefer_h200"
    # Both idle: in_flight scores both 1, the deployment scorer adds 0.6 to the H200.
    decision = router.route(RoutingRequest("r1", "m", "chat"), policy)
    assert (decision.pod.name, decision.reason) == ("h200", "preferred")
    assert decision.scores == pytest.approx({"a100": 1.0, "h200": 1.6})
    # One request on the H200: 1/2 + 0.6 still beats the idle A100's 1.
    busy(ledger, "h200")
    decision = router.route(RoutingRequest("r2", "m", "chat"), policy)
    assert decision.pod.name == "h200" and decision.scores == pytest.approx({"a100": 1.0, "h200": 1.1})
    # Two: 1/3 + 0.6 < 1, the idle A100 wins.
    busy(ledger, "h200")
    decision = router.route(RoutingRequest("r3", "m", "chat"), policy)
    assert decision.pod.name == "a100" and decision.scores["h200"] == pytest.approx(1 / 3 + 0.6)


def test_a_shipped_profile_and_a_declared_one_are_both_picked_by_name():
    pods = registry()
    router = router_for(PREFER_H200, pods)
    assert {"prefer_h200", "kv_aware", "round_robin"} <= set(router.profiles.names())
    assert router.resolve("round_robin").name == "round_robin"
    assert router.route(RoutingRequest("r", "m", "chat"), router.resolve("prefer_h200")).pod.name == "h200"


def test_the_pin_is_a_filter_the_profile_declares():
    pods = registry()
    pinned = router_for(PREFER_H200, pods)
    decision = pinned.route(RoutingRequest("r", "m", "chat"), pinned.resolve(None), pin="a100",
                            pin_reason="workflow_preserve")
    # The pin settles the choice; the scorers still ranked every candidate (an edge's fallbacks).
    assert (decision.pod.name, decision.reason, decision.detail) == ("a100", "workflow_preserve", "pinned")
    assert set(decision.scores) == {"a100", "h200"} and decision.unpinned is None
    unpinned = router_for(PREFER_H200.replace("[saturated, adapter_resident, pin]", "[saturated]"), pods)
    decision = unpinned.route(RoutingRequest("r", "m", "chat"), unpinned.resolve(None), pin="a100")
    assert (decision.pod.name, decision.unpinned, decision.unpinned_by) == ("h200", "a100", "placement")


def test_flow_controls_pods_with_room_is_the_saturated_filter():
    pods = registry()
    router = router_for(PREFER_H200, pods)
    released = RoutingRequest("r", "m", "chat", room=frozenset({"a100"}))
    decision = router.route(released, router.resolve(None))
    assert decision.pod.name == "a100" and released.filtered_out == {"saturated": ["h200"]}
    # A pinned request is exempt: its pin decides; when the pin's pod is dropped, the filter is named.
    decision = router.route(RoutingRequest("r", "m", "chat", room=frozenset({"a100"})), router.resolve(None),
                            pin="h200", pin_reason="session")
    assert (decision.pod.name, decision.reason) == ("h200", "session")


@pytest.mark.parametrize(("profile", "error", "fragment"), [
    ({"scorers": ["prefx"]}, UnknownPlugin, "routing profile 'mine': unknown routing scorer 'prefx'"),
    ({"filters": [{"name": "overload_guard", "options": {"slak": 1}}]}, PluginOptionsError, "slak"),
    ({"picker": "best"}, UnknownPlugin, "known: cache_aware, max_score"),
])
def test_a_bad_profile_stops_the_start_naming_the_part(profile, error, fragment):
    with pytest.raises(error, match=fragment):
        router_for(yaml.safe_dump({"routing": {"profiles": {"mine": profile}}}), registry())


def test_a_declared_profile_may_not_take_a_shipped_name_nor_routing_options():
    with pytest.raises(PluginOptionsError, match="kv_aware is a shipped profile's name"):
        router_for("routing: {profiles: {kv_aware: {picker: random}}}", registry())
    with pytest.raises(PluginOptionsError, match="mine is a declared profile"):
        router_for("routing: {profiles: {mine: {picker: random}}, options: {mine: {seed: 1}}}", registry())


def test_config_check_prints_a_declared_profile_with_its_defaults_and_a_shipped_ones_parts(tmp_path, capsys):
    from gateway.cli import main

    path = tmp_path / "profiles.yaml"
    path.write_text(PREFER_H200 + "  options: {kv_aware: {load_weight: 0.5}}\n")
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    profile = yaml.safe_load(out)["routing"]["profiles"]["prefer_h200"]
    assert profile["scorers"][1] == {"name": "deployment", "options": {"prefer": ["h200"]}, "weight": 0.6}
    assert profile["filters"][0] == {"name": "saturated", "options": {}}
    # The shipped profile in use, spelled out (as a comment: it is not part of the config).
    assert "# shipped routing profile kv_aware" in out and "#   - name: resumable_load" in out
    path.write_text(out)  # what it prints is a config that checks the same
    assert main(["config", "check", str(path)]) == 0 and capsys.readouterr().out == out


def test_weights_are_finite_numbers():
    with pytest.raises(ConfigError, match="weight must be a finite number"):
        load_config(overrides={"routing": {"profiles": {"p": {"scorers": [{"name": "load", "weight": float("inf")}]}}}})
