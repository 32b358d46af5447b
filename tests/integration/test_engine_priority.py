"""A pod that orders its waiting requests by priority (vLLM ``--scheduling-policy priority``) serves the least-served
flow's request first: the gateway gives each request its band and its flow's service as the priority
(``X-Vllm-Priority``), and the simulated pod schedules by it as vLLM does."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from bench.workloads import FAIRNESS_HEADER

STEP_TOKENS = 256  # the pod's step budget: a queued 200-token prompt after another is chunked into the next step


async def first_token_at(http, url: str, tenant: str, prompt: list[int]) -> float:
    body = {"model": "mock-llama", "prompt": prompt, "max_tokens": 2, "stream": True}
    async with http.post(f"{url}/v1/completions", json=body, headers={FAIRNESS_HEADER: tenant}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                return time.monotonic()
    raise AssertionError("no token")


@pytest.mark.parametrize("scheduling", ["priority", "fcfs"])
async def test_a_priority_pod_serves_the_least_served_flows_waiting_request_first(start_mock_pod, start_gateway,
                                                                                  http, scheduling: str):
    pod = await start_mock_pod(speed=1.0, max_batched_tokens=STEP_TOKENS, scheduling_policy=scheduling)
    # Nothing is held at the gateway: the requests queue in the pod, which alone decides their order.
    gw = await start_gateway([{"url": pod.url, "scheduling": scheduling}], routing={"policy": "least_request"},
                             flow_control={"saturation": {"prefill_tokens": 1_000_000, "engine_waiting": 1000}})
    rng = random.Random(3)
    ids = lambda n: [rng.randrange(100, 4000) for _ in range(n)]  # noqa: E731
    await first_token_at(http, gw.url, "A", ids(1500))  # A has been served far more than B
    await first_token_at(http, gw.url, "B", ids(20))
    long = asyncio.create_task(first_token_at(http, gw.url, "A", ids(10 * STEP_TOKENS)))  # ten steps of prefill
    await asyncio.sleep(0.05)
    a = asyncio.create_task(first_token_at(http, gw.url, "A", ids(200)))  # both wait behind it in the pod, A's first
    await asyncio.sleep(0.05)
    b = asyncio.create_task(first_token_at(http, gw.url, "B", ids(200)))
    await asyncio.sleep(0.02)
    assert not long.done() and len(pod.engine.waiting) == 2
    priorities = [s.priority for s in pod.engine.waiting]  # in the pod's order
    if scheduling == "priority":  # each flow's service as the request left: B's little, A's its two prompts
        assert priorities[0] < 100 and priorities[1] > 1500 + 10 * STEP_TOKENS, priorities
    else:
        assert priorities == [0, 0]
    _, a_at, b_at = await asyncio.gather(long, a, b)
    if scheduling == "priority":
        assert b_at < a_at  # B, the least served, first
    else:
        assert a_at < b_at  # first come, first served: the header is sent only to a pod that orders by it
