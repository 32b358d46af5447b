"""Many simulated pods in one process, each a whole pod on the wire; and the synthetic KV-event firehose."""

from __future__ import annotations

import logging
import random
import socket
import urllib.request

import msgspec
import pytest

from gateway.config import GatewayConfig
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriber import KvEventSubscriber
from simulator import launcher
from simulator.config import MockPodsConfig
from simulator.group import MockPodGroup
from simulator.launcher import MockPodFleet
from simulator.pod import MockPodConfig
from simulator.ports import free_ports
from tests.integration.test_kv_subscriber import eventually

MODEL = "mock-llama"


def subscribed(index: PrefixIndex, name: str, events: str, replay: str) -> KvEventSubscriber:
    sub = KvEventSubscriber(index, index.view(name, 0, MODEL, 16), events, replay)
    sub.start()
    return sub


async def test_pods_of_one_process_each_answer_publish_and_replay_on_their_own(http, tokenizer):
    group = MockPodGroup(MockPodConfig(port=0, events_port=0, replay_port=0, speed=0.0), 3, tokenizer)
    endpoints = await group.start()
    index = PrefixIndex()
    subs = [subscribed(index, f"pod{e.index}", e.events, e.replay) for e in endpoints]
    try:
        assert [e.index for e in endpoints] == [0, 1, 2]
        assert len({e.url for e in endpoints} | {e.events for e in endpoints} | {e.replay for e in endpoints}) == 9
        ids = list(range(100, 100 + 16 * 5 + 1))
        async with http.post(f"{endpoints[1].url}/v1/completions",
                             json={"model": MODEL, "prompt": ids, "max_tokens": 1}) as resp:
            assert resp.status == 200
        await eventually(lambda: index.lookup(MODEL, None, ids, ["pod1"])["pod1"].gpu_tokens == 80)
        assert index.blocks_on("pod0") == index.blocks_on("pod2") == 0
        assert [p.publisher.seq for p in group.pods] == [0, group.pods[1].publisher.seq, 0]
        async with http.get(f"{endpoints[2].url}/metrics") as resp:
            assert 'vllm:prefix_cache_queries_total{engine="0",model_name="mock-llama"} 0.0' in await resp.text()
    finally:
        for sub in subs:
            await sub.stop()
        await group.stop()


async def test_a_firehose_keeps_each_pod_at_its_held_blocks_while_it_stores_and_removes(tokenizer):
    group = MockPodGroup(MockPodConfig(port=0, events_port=0, replay_port=0, speed=0.0), 2, tokenizer,
                         synthetic_events=3200, synthetic_hold=4)
    endpoints = await group.start()
    index = PrefixIndex()
    subs = [subscribed(index, f"pod{e.index}", e.events, e.replay) for e in endpoints]
    try:
        await eventually(lambda: index.stats.blocks_removed > 2000, within_s=10)
        assert all(index.blocks_on(f"pod{i}") <= 4 * 16 + 16 for i in range(2))  # 4 batches held, one more on the way
        assert index.stats.unknown_parent == 0 and index.stats.rejected == 0
        assert index.own_hashes("pod0").isdisjoint(index.own_hashes("pod1"))  # no two pods share a block
    finally:
        for sub in subs:
            await sub.stop()
        await group.stop()


def test_the_launcher_spreads_a_fleet_over_processes_and_names_its_pods_in_order():
    fleet = MockPodFleet(MockPodsConfig(count=5, speed=0, per_process=3), quiet=True)
    try:
        pods = fleet.start(timeout_s=60)
        assert [p.name for p in pods] == [f"mock-{i}" for i in range(5)] and len(fleet.members) == 2
        assert all(p.kv_events and p.kv_replay for p in pods)
        for pod in pods:
            with urllib.request.urlopen(f"{pod.url}/v1/models", timeout=5) as resp:
                assert msgspec.json.decode(resp.read())["data"][0]["id"] == MODEL
    finally:
        fleet.stop()
    assert not fleet.members


def test_a_pod_that_cannot_bind_its_port_is_started_again_on_others_and_says_why(monkeypatch, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen = iter([[taken.getsockname()[1], *free_ports(2)]])  # the first plan: a port another listener holds
    monkeypatch.setattr(launcher, "free_ports", lambda n, host, **kw: next(chosen, None) or free_ports(n, host, **kw))
    fleet = MockPodFleet(MockPodsConfig(count=1, speed=0), quiet=True)
    try:
        with caplog.at_level(logging.WARNING, logger="simulator"):
            [pod] = fleet.start(timeout_s=60)
        with urllib.request.urlopen(f"{pod.url}/v1/models", timeout=5) as resp:
            assert resp.status == 200
        assert launcher.port_of(pod.url) != taken.getsockname()[1]
        [warning] = [r.getMessage() for r in caplog.records if "starting them again" in r.getMessage()]
        assert "exited with 1: " in warning and "address" in warning.lower()  # the pod's own last word
    finally:
        fleet.stop()
        taken.close()


class ScriptedPorts(random.Random):
    """Draws the given ports in order (then any)."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(0)
        self.ports = ports

    def randint(self, a: int, b: int) -> int:
        return self.ports.pop(0) if self.ports else super().randint(a, b)


def test_a_port_someone_is_about_to_bind_is_never_chosen():
    gateway, other = free_ports(2)
    assert free_ports(1, rng=ScriptedPorts([gateway, other]), avoid=frozenset({gateway})) == [other]
    assert free_ports(1, rng=ScriptedPorts([gateway, other])) == [gateway]


async def test_pods_beside_a_gateway_are_not_given_its_ports(monkeypatch):
    asked: list[frozenset[int]] = []
    monkeypatch.setattr(launcher, "free_ports", lambda n, host, **kw: asked.append(kw["avoid"]) or free_ports(n, host))
    config = msgspec.convert({"server": {"port": 18123}, "epp": {"port": 18124},
                              "mock_pods": {"count": 1, "speed": 0, "per_process": 1}}, GatewayConfig)
    config, pods = await launcher.start_beside_gateway(config)
    try:
        await pods.started()
        assert asked == [frozenset({18123, 18124})]
        assert all(launcher.port_of(p.url) not in (18123, 18124) for p in config.pods)
    finally:
        pods.stop()


@pytest.mark.parametrize("planned", [False, True])
async def test_pods_that_exit_while_starting_are_started_again_unless_the_gateway_has_their_ports(planned, caplog,
                                                                                                 http):
    fleet = MockPodFleet(MockPodsConfig(count=2, speed=0, per_process=1 if planned else 2), quiet=True)
    pods = launcher.PodsBesideGateway(fleet, fleet.spawn())
    assert (pods.pods is not None) is planned
    exited = fleet.members[0].process
    exited.kill()  # as a pod that found its port taken exits
    exited.wait()
    try:
        if planned:  # the gateway routes to the ports it was given: a pod elsewhere would be no pod of its
            with pytest.raises(launcher.PodExited):
                await pods.started(timeout_s=60)
            return
        with caplog.at_level(logging.WARNING, logger="simulator"):
            await pods.started(timeout_s=60)
        assert pods.pods is not None and len(pods.pods) == 2
        for pod in pods.pods:
            async with http.get(f"{pod.url}/v1/models") as resp:
                assert resp.status == 200
        assert any("starting them again" in r.getMessage() for r in caplog.records)
    finally:
        pods.stop()
