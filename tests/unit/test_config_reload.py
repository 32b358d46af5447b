"""Reloading the config file: what applies live, what waits for a restart, and a bad file changing nothing."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.config import ConfigSource, FlowControlConfig, load_config
from gateway.config_reload import ConfigReloader, ReloadMetrics, changed_sections
from tests.conftest import eventually

BASE = {"pods": [{"url": "http://127.0.0.1:9"}], "flow_control": {"enabled": True}}


def write(path: Path, data: dict) -> None:
    path.write_text(yaml.safe_dump(data))


def with_flow(**flow_control) -> dict:
    return {**BASE, "flow_control": {**BASE["flow_control"], **flow_control}}


class Applied:
    """Stands in for the flow controller: keeps each flow-control config it is given."""

    def __init__(self) -> None:
        self.configs: list[FlowControlConfig] = []

    def __call__(self, config: FlowControlConfig) -> None:
        self.configs.append(config)


def reloader_for(path: Path, interval_s: float = 0.0) -> tuple[ConfigReloader, Applied, CollectorRegistry]:
    applied, registry = Applied(), CollectorRegistry()
    reloader = ConfigReloader(ConfigSource.read(str(path)), {"flow_control": applied}, ReloadMetrics(registry),
                              interval_s)
    return reloader, applied, registry


def reloads(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("gateway_config_reloads_total", {"outcome": outcome}) or 0.0


def test_sections_split_into_live_and_restart():
    old = load_config(overrides=BASE)
    objectives = load_config(overrides=with_flow(objectives={"chat": {"priority": 5}}))
    assert changed_sections(old, objectives) == (["flow_control"], [])
    policy = load_config(overrides={**BASE, "routing": {"policy": "kv_aware"}})
    assert changed_sections(old, policy) == (["routing"], [])
    # The director was given its retries: a restart; the shortlist size that came with them applies now.
    retries = load_config(overrides={**BASE, "routing": {"max_retries": 5, "max_candidates": 4}})
    assert changed_sections(old, retries) == (["routing"], ["routing.max_retries"])
    port = load_config(overrides={**BASE, "server": {"port": 9999}})
    assert changed_sections(old, port) == ([], ["server"])
    # Turning flow control off changes the pipeline: a restart; the weights that came with it apply now.
    off = load_config(overrides=with_flow(enabled=False, tenants={"A": {"weight": 2}}))
    assert changed_sections(old, off) == (["flow_control"], ["flow_control.enabled"])
    only_off = load_config(overrides=with_flow(enabled=False))
    assert changed_sections(old, only_off) == ([], ["flow_control.enabled"])


async def test_a_changed_objective_and_weight_are_applied(tmp_path):
    path = tmp_path / "gateway.yaml"
    write(path, BASE)
    reloader, applied, registry = reloader_for(path)
    write(path, with_flow(objectives={"chat": {"priority": 5, "weight": 3}}, tenants={"A": {"weight": 2}}))
    assert await reloader.reload() == "applied"
    config = applied.configs[-1]
    assert config.objectives["chat"].priority == 5 and config.tenants["A"].weight == 2 and config.enabled
    assert reloader.source.loaded.flow_control == config
    assert await reloader.reload() == "unchanged" and len(applied.configs) == 1
    assert reloads(registry, "applied") == 1 and reloads(registry, "unchanged") == 1


@pytest.mark.parametrize("text", ["flow_control: {objectives: {chat: {priority: high}}}", "flow_control: [", "- 1"])
async def test_a_bad_file_is_refused_and_the_running_config_stays(tmp_path, text, caplog):
    path = tmp_path / "gateway.yaml"
    write(path, with_flow(objectives={"chat": {"priority": 5}}))
    reloader, applied, registry = reloader_for(path)
    before = reloader.source
    path.write_text(text)
    with caplog.at_level(logging.ERROR, "gateway.config"):
        assert await reloader.reload() == "invalid"
    assert applied.configs == [] and reloader.source is before
    assert reloads(registry, "invalid") == 1
    assert registry.get_sample_value("gateway_config_last_reload_successful") == 0
    assert "config reload refused, the running config stays" in caplog.text
    write(path, with_flow(objectives={"chat": {"priority": 6}}))
    assert await reloader.reload() == "applied" and applied.configs[-1].objectives["chat"].priority == 6
    assert registry.get_sample_value("gateway_config_last_reload_successful") == 1


async def test_what_needs_a_restart_is_logged_until_then_and_the_rest_applies(tmp_path, caplog):
    path = tmp_path / "gateway.yaml"
    write(path, BASE)
    reloader, applied, registry = reloader_for(path)
    write(path, {**with_flow(enabled=False, max_wait_s=7), "server": {"port": 9999}})
    with caplog.at_level(logging.WARNING, "gateway.config"):
        assert await reloader.reload() == "restart_needed"
    assert "server, flow_control.enabled changed and applies after a restart" in caplog.text
    # The live part applies; flow control stays on, as the pipeline was built.
    assert applied.configs[-1].max_wait_s == 7 and applied.configs[-1].enabled
    running = reloader.source.loaded
    assert running.server.port != 9999 and running.flow_control.enabled
    assert await reloader.reload() == "restart_needed" and len(applied.configs) == 1
    assert reloads(registry, "restart_needed") == 2


async def test_the_file_is_watched_and_a_signal_rereads_it(tmp_path):
    path = tmp_path / "gateway.yaml"
    write(path, BASE)
    reloader, applied, registry = reloader_for(path, interval_s=0.02)
    await reloader.start()
    try:
        await asyncio.sleep(0.1)
        assert reloads(registry, "unchanged") == 0  # the same bytes are not read again
        write(path, with_flow(max_queued=9))
        await eventually(lambda: applied.configs and applied.configs[-1].max_queued == 9)
        reloader.request()
        await eventually(lambda: reloads(registry, "unchanged") == 1)
    finally:
        await reloader.stop()


async def test_without_a_file_there_is_nothing_to_watch():
    reloader = ConfigReloader(ConfigSource.read(None, BASE), {"flow_control": Applied()},
                              ReloadMetrics(CollectorRegistry()), 0.01)
    await reloader.start()
    reloader.request()  # nothing to read: ignored
    await reloader.stop()



async def test_model_rules_adapters_and_limits_apply_to_a_running_gateway(tmp_path):
    from multidict import CIMultiDict

    from gateway.app import build_gateway
    from gateway.core.inference_api import parse_inference_request

    path = tmp_path / "gateway.yaml"
    write(path, {**BASE, "models": {"rules": {"mini": {"target": "llama"}}}})
    source = ConfigSource.read(str(path))
    gateway = build_gateway(source.loaded, source=source)
    body = parse_inference_request(b'{"model": "mini"}')
    assert gateway.models.rules.route("mini", "chat", CIMultiDict(), body).targets == ("llama",)
    write(path, {**BASE, "models": {"rules": {"mini": {"target": "qwen", "fallbacks": ["llama"]}},
                                    "adapters": {"sql": {"path": "/a/sql", "base_model": "qwen"}}},
                 "limits": {"tenants": {"team": {"max_concurrent": 3}}}})
    assert gateway.reload.reloader is not None and await gateway.reload.reloader.reload() == "applied"
    assert gateway.models.rules.route("mini", "chat", CIMultiDict(), body).targets == ("qwen", "llama")
    assert gateway.foundation.pods.loadable == {"sql": "qwen"} and gateway.foundation.pods.base_model("sql") == "qwen"
    assert gateway.limits.limits.config.tenants["team"].max_concurrent == 3
    write(path, {**BASE, "models": {"rules": {"mini": {"target": "mini"}}}})  # a bad rule: nothing changes
    assert await gateway.reload.reloader.reload() == "invalid"
    assert gateway.models.rules.route("mini", "chat", CIMultiDict(), body).targets == ("qwen", "llama")


async def test_routing_profiles_default_and_shortlist_apply_to_a_running_gateway_or_nothing_does(tmp_path, caplog):
    """A declared profile, its weights, the default policy and the shortlist size change on reload; a profile
    naming an unknown scorer is refused before anything applies (the flow-control change beside it too)."""
    from gateway.app import build_gateway

    path = tmp_path / "gateway.yaml"
    write(path, BASE)
    source = ConfigSource.read(str(path))
    gateway = build_gateway(source.loaded, source=source)
    router = gateway.routing.router
    assert router.default_policy == "round_robin" and "mine" not in router.profiles.names()
    profile = {"filters": ["saturated"], "scorers": [{"name": "prefix", "weight": 3}, "load"]}
    write(path, {**with_flow(max_queued=9), "routing": {"policy": "mine", "profiles": {"mine": profile},
                                                        "max_candidates": 4, "max_retries": 7}})
    assert gateway.reload.reloader is not None and await gateway.reload.reloader.reload() == "restart_needed"
    policy = router.resolve(None)
    assert router.default_policy == "mine" and policy.name == "mine"
    assert [ws.weight for ws in policy.scorers] == [3, 1]
    assert router._shortlist.limit == 4 and gateway.flow.flow.config.max_queued == 9
    # The director keeps its retries until a restart.
    assert gateway.reload.reloader.source.loaded.routing.max_retries == 2
    bad = {**profile, "scorers": [{"name": "no_such_scorer"}]}
    write(path, {**with_flow(max_queued=11), "routing": {"policy": "mine", "profiles": {"mine": bad}}})
    with caplog.at_level(logging.ERROR, "gateway.config"):
        assert await gateway.reload.reloader.reload() == "invalid"
    assert "no_such_scorer" in caplog.text
    assert router.resolve(None) is policy and router._shortlist.limit == 4 and gateway.flow.flow.config.max_queued == 9
