"""Several gateway processes acting as one: the workers of one replica (Unix datagrams and the shared load
table) and replicas sharing one Redis, each in front of the same simulated pods. Every test sends a
workflow's or session's requests to the processes in turn and checks where they went and why."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import msgspec
import pytest

from gateway.cluster.identity import WorkerIdentity
from gateway.flow.release_order import SharedReleaseOrder
from gateway.load.shared_table import SharedLoadTable
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from tests.conftest import eventually

MODEL = "mock-llama"
CONTEXT = "You are an agent reviewing a pull request, file by file. " * 40
FAST_BUS = {"flush_ms": 1.0, "heartbeat_s": 0.2, "peer_timeout_s": 1.0, "redis_timeout_s": 0.3}


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gw-", dir="/tmp")  # short: Unix socket paths are limited to 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def pods_for(start_mock_pod, n: int = 4) -> list[dict]:
    pods = [await start_mock_pod(num_blocks=400) for _ in range(n)]
    return [msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"} for i, p in enumerate(pods)]


async def start_group(start_gateway, pods: list[dict], identities: list[WorkerIdentity | None], policy: str,
                      **shared_state):
    return [await start_gateway(pods, identity=identity, routing={"policy": policy},
                                tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
                                shared_state={**FAST_BUS, **shared_state})
            for identity in identities]


def two_workers(run_dir: str) -> list[WorkerIdentity | None]:
    SharedLoadTable.create(WorkerIdentity("r", 0, 2, run_dir).load_table, 2).close()
    SharedReleaseOrder.create(WorkerIdentity("r", 0, 2, run_dir).release_order, 2).close()
    return [WorkerIdentity("r", i, 2, run_dir) for i in range(2)]


async def post(http, gw, history: list[dict], **headers: str) -> tuple[str, str, dict]:
    body = {"model": MODEL, "messages": history, "max_tokens": 8}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-gateway-pod"], resp.headers.get("x-gateway-cache-action", ""), await resp.json()


async def alternate_stages(http, gateways, workflow: str, stages: int) -> tuple[list[str], list[str]]:
    """A workflow's stages sent to each gateway in turn, each once the previous one is known to all."""
    history = [{"role": "system", "content": CONTEXT}]
    pods, actions = [], []
    for i in range(stages):
        history.append({"role": "user", "content": f"File {i}: any issue?"})
        gw = gateways[i % len(gateways)]
        pod, action, payload = await post(http, gw, history, **{"x-workflow-id": workflow, "x-stage-id": f"s{i}"})
        pods.append(pod)
        actions.append(action)
        history.append(payload["choices"][0]["message"])
        await eventually(lambda i=i, pod=pod: all(stage_known(g, workflow, f"s{i}", pod) for g in gateways))
    return pods, actions


def stage_known(gw, workflow: str, stage: str, pod: str) -> bool:
    wf = gw.kits.workflows.service.tracker.workflows.get(workflow)
    return wf is not None and stage in wf.stages and wf.stages[stage].pod == pod and wf.stages[stage].completed


async def test_a_workflow_whose_stages_reach_both_workers_keeps_one_pod(start_mock_pod, start_gateway, http,
                                                                        run_dir):
    pods = await pods_for(start_mock_pod)
    gateways = await start_group(start_gateway, pods, two_workers(run_dir), "round_robin")
    pods_used, actions = await alternate_stages(http, gateways, "wf-a", 6)
    # Round robin on its own would move every stage; the workers share the workflow, so each stage after
    # the first stays where the cache is, whichever worker it reached.
    assert len(set(pods_used)) == 1
    assert actions == ["noop"] + ["preserve:small_increment"] * 5
    states = [await (await http.get(f"{gw.url}/v1/workflows/wf-a")).json() for gw in gateways]
    assert states[0]["stages"] == states[1]["stages"] and states[0]["cache"] == states[1]["cache"]


async def test_a_session_sticks_to_one_pod_across_workers(start_mock_pod, start_gateway, http, run_dir):
    pods = await pods_for(start_mock_pod)
    gateways = await start_group(start_gateway, pods, two_workers(run_dir), "round_robin")
    history = [{"role": "user", "content": "Summarise the design."}]
    seen = []
    for i in range(6):
        gw = gateways[i % 2]
        pod, _, _ = await post(http, gw, history, **{"x-session-id": "sess-1"})
        seen.append(pod)
        await eventually(lambda pod=pod: all(g.kits.workflows.service.sessions.pod_of("sess-1") == pod
                                             for g in gateways))
    assert len(set(seen)) == 1


async def test_workers_weigh_each_others_contexts_and_speculative_blocks(start_mock_pod, start_gateway, http,
                                                                         run_dir):
    pods = await pods_for(start_mock_pod, 2)
    first, second = await start_group(start_gateway, pods, two_workers(run_dir), "kv_aware")
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Begin."}]
    pod, _, _ = await post(http, first, history, **{"x-workflow-id": "wf-c"})
    working_set = second.kits.kv.working_set
    await eventually(lambda: (ctx := working_set.context("workflow:wf-c")) is not None and ctx.pod == pod
                     and ctx.thinking and not second.kits.shared.ledger.of_context(ctx.key))
    assert working_set.demand_tokens(pod, 0.0) > 0
    other = next(p["name"] for p in pods if p["name"] != pod)
    assert working_set.demand_tokens(other, 0.0) == 0
    # The second worker's index expects the first's blocks on that pod before any event says so.
    assert second.kits.kv.index._speculative


async def test_replicas_share_workflows_through_redis_and_survive_its_loss(start_mock_pod, start_gateway, http,
                                                                          redis_server):
    pods = await pods_for(start_mock_pod)
    gateways = await start_group(start_gateway, pods, [None, None], "round_robin", redis_url=redis_server.url)
    buses = [gw.kits.shared.bus for gw in gateways]
    await eventually(lambda: all(len(bus.peers) == 1 for bus in buses), within_s=10)
    pods_used, actions = await alternate_stages(http, gateways, "wf-r", 4)
    assert len(set(pods_used)) == 1 and actions == ["noop"] + ["preserve:small_increment"] * 3

    redis_server.stop()
    history = [{"role": "user", "content": "Redis is gone; keep answering."}]
    for i in range(10):  # every request is answered: shared state is never on the request path
        await post(http, gateways[i % 2], history, **{"x-workflow-id": "wf-lost", "x-stage-id": f"s{i}"})
    await eventually(lambda: not any(bus.redis_up for bus in buses), within_s=10)
    text = await (await http.get(f"{gateways[0].url}/metrics")).text()
    assert "gateway_shared_state_redis_up 0.0" in text and 'gateway_shared_state_errors_total{link="redis"' in text

    redis_server.start()  # same port: the links come back by themselves
    await eventually(lambda: all(bus.redis_up for bus in buses), within_s=15)
    pods_used, actions = await alternate_stages(http, gateways, "wf-back", 3)
    assert len(set(pods_used)) == 1 and actions == ["noop"] + ["preserve:small_increment"] * 2
