"""Keep-warm against a simulated vLLM pod (whose block pool is vLLM's: ``tests/e2e/test_keep_warm.py``): a
thinking workflow keeps its blocks through other clients' traffic that would have evicted them, and what the
refreshes cost is counted."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bench.metrics_text import KeepWarmSpent, keep_warm_spent
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from tests.integration.test_workflows import MODEL, stage

CONTEXT = "You are an agent reviewing a storage migration plan, step by step, with care. " * 6


async def gateway_with_one_small_pod(start_mock_pod, start_gateway, keep_warm: bool):
    # 30 blocks of 16 tokens (29 usable): the workflow's context (~14 blocks) and two others' do not fit.
    pod = await start_mock_pod(num_blocks=30, block_size=16)
    gw = await start_gateway(
        [msgspec.to_builtins(pod.pod_config()) | {"name": "pod0"}], routing={"policy": "kv_aware"},
        tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
        load={"scrape_interval_s": 0.1}, placement={"default_think_s": 5.0},
        workflow={"keep_warm": {"enabled": keep_warm, "min_tokens": 32, "interval_s": 0.05, "lead_s": 1.0,
                                "max_share": 1.0}})
    return pod, gw


async def other_clients(http, gw, n: int) -> None:
    """One-off workflows of other clients, one after another: their blocks are what the pod should evict."""
    for i in range(n):
        text = f"Unrelated request number {i}: " + " ".join(f"w{i}x{j}" for j in range(40))
        await stage(http, gw, f"other-{i}", "s", [{"role": "user", "content": text}],
                    **{"x-workflow-complete": "true"})
        await asyncio.sleep(0.15)


async def spent_and_debug(http, gw) -> tuple[KeepWarmSpent | None, dict]:
    """What the refreshes cost (``/metrics``) and keep-warm's page, read until no refresh ended in between: the
    workflow thinks again after its stage, and keep-warm goes on refreshing it while they are read."""
    async def spent() -> KeepWarmSpent | None:
        async with http.get(f"{gw.url}/metrics") as resp:
            return keep_warm_spent(await resp.text()).get("pod0")

    for _ in range(20):
        before = await spent()
        async with http.get(f"{gw.url}/debug/placement") as resp:
            debug = (await resp.json())["keep_warm"]
        after = await spent()
        if before == after:
            return after, debug
    raise AssertionError("a refresh ended between every two reads of /metrics")


@pytest.mark.parametrize("keep_warm", [True, False])
async def test_a_thinking_workflow_keeps_its_blocks_through_traffic_that_would_evict_them(
        start_mock_pod, start_gateway, http, keep_warm):
    _pod, gw = await gateway_with_one_small_pod(start_mock_pod, start_gateway, keep_warm)
    history = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Step 1."}]
    await stage(http, gw, "wf", "s1", history)
    await other_clients(http, gw, 6)
    history.append({"role": "user", "content": "Step 2."})
    _, _, payload = await stage(http, gw, "wf", "s2", history)
    cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    spent, debug = await spent_and_debug(http, gw)
    if keep_warm:
        # Refreshed while the others came and went: it found (nearly) all it left, at one computed token a
        # refresh.
        assert cached >= 10 * 16, debug
        assert spent is not None and spent.requests >= 1 and spent.prompt_tokens - spent.cached_tokens <= \
            spent.requests * 16, debug
        assert debug["pods"]["pod0"]["refreshes"] == spent.requests and debug["returns"]["kept"] == 1
    else:
        assert cached < 4 * 16 and spent is None and debug == {"enabled": False}
