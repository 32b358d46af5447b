"""What a real vLLM pod keeps in its prefix cache, and what the gateway does about it: the simulated pod's block
pool checked event for event against vLLM's, and a prompt-only refresh keeping a context vLLM would evict.

One pod of 48 blocks of 128 tokens (``--num-gpu-blocks-override``), so a few contexts overflow it. Requests go
one at a time with token-id prompts, so the engine's behaviour is deterministic.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from tests.e2e.conftest import BLOCK_SIZE, MODEL, VllmFleet, VllmPod, running_pods
from tests.e2e.kv_replay import replayed_batches
from tests.e2e.test_real_vllm import pod_metric, post

NUM_BLOCKS = 48
VOCAB = range(100, 4000)  # the tiny model's vocabulary has 4,096 ids


@pytest.fixture(scope="module")
def small_pod(model_dir: str) -> Iterator[VllmPod]:
    fleet: VllmFleet
    for fleet in running_pods(model_dir, [("keepwarm", ("--num-gpu-blocks-override", str(NUM_BLOCKS)), {})]):
        yield fleet[0]


async def replayed_events(endpoint: str) -> list[KvEvent]:
    """Every event the pod still buffers, in order, from its replay endpoint."""
    return [event for batch in await replayed_batches(endpoint) for event in batch]


def since_last_clear(events: list[KvEvent]) -> list[KvEvent]:
    cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    return events[cleared[-1] + 1:] if cleared else events


def block_trace(events: list[KvEvent]) -> list[tuple[str, int]]:
    """The events as ("stored" | "removed", block), each block numbered by the order in which a block of its
    contents (its tokens and its parent's) was first stored. Engines hash blocks differently and generate
    different answers, but the same cache behaviour gives the same trace."""
    number: dict[tuple[Any, tuple[int, ...]], int] = {}
    contents: dict[Any, tuple[Any, tuple[int, ...]]] = {}
    trace: list[tuple[str, int]] = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = contents.get(event.parent_block_hash) if event.parent_block_hash is not None else None
            for i, block_hash in enumerate(event.block_hashes):
                key = (parent, tuple(event.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
                contents[block_hash] = key
                trace.append(("stored", number.setdefault(key, len(number))))
                parent = key
        elif isinstance(event, BlockRemoved):
            trace += [("removed", number[contents[h]]) for h in event.block_hashes]
    return trace


def request_sequence(seed: int) -> list[dict[str, Any]]:
    """Prompts over a few shared prefixes and contexts, some block-aligned, some repeated, answers of 1 to 140
    tokens (past a block), together several times the pod's 47 usable blocks."""
    rng = random.Random(seed)
    preamble = [rng.choice(VOCAB) for _ in range(4 * BLOCK_SIZE)]
    contexts = [[rng.choice(VOCAB) for _ in range(rng.choice([300, 640, 900]))] for _ in range(12)]
    out = []
    for _ in range(40):
        context = rng.choice(contexts)
        prompt = preamble[: rng.choice([0, 2, 3, 4]) * BLOCK_SIZE] + context[: rng.randrange(100, len(context))]
        out.append({"prompt": prompt, "max_tokens": rng.choice([1, 8, 140]), "ignore_eos": True,
                    "temperature": 0.0})
    return out


async def replay_sequence(http: aiohttp.ClientSession, url: str, requests: list[dict[str, Any]]) -> list[int]:
    """Send the requests one after the other; the cached tokens of each."""
    cached = []
    for body in requests:
        answer, _ = await post(http, f"{url}/v1/completions", {"model": MODEL, **body})
        assert answer["usage"]["completion_tokens"] == body["max_tokens"]
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached


async def reset(http: aiohttp.ClientSession, url: str) -> None:
    body, _ = await post(http, f"{url}/reset_prefix_cache", {})
    assert body.get("success", True), body


async def test_the_simulated_pod_stores_and_evicts_blocks_as_vllm_does(small_pod: VllmPod, start_mock_pod, http):
    mock = await start_mock_pod(model=MODEL, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    pods = {"vllm": (small_pod.url, f"tcp://127.0.0.1:{small_pod.replay_port}"),
            "mock": (mock.url, mock.pod_config().kv_replay)}
    requests = request_sequence(seed=7)
    cached, traces, hits = {}, {}, {}
    for name, (url, replay) in pods.items():
        await reset(http, url)
        before = await pod_metric(http, url, "vllm:prefix_cache_hits_total")
        cached[name] = await replay_sequence(http, url, requests)
        hits[name] = await pod_metric(http, url, "vllm:prefix_cache_hits_total") - before
        traces[name] = block_trace(since_last_clear(await replayed_events(replay)))
    evictions = sum(1 for op, _ in traces["vllm"] if op == "removed")
    assert evictions > 40, "the sequence must overflow the pod's cache to say anything about its LRU"
    assert sum(cached["vllm"]) > 0
    assert cached["mock"] == cached["vllm"] and hits["mock"] == hits["vllm"]
    first_difference = next((i for i, (a, b) in enumerate(zip(traces["mock"], traces["vllm"], strict=False))
                             if a != b), None)
    assert first_difference is None and len(traces["mock"]) == len(traces["vllm"]), (
        first_difference, traces["vllm"][first_difference or 0:][:12], traces["mock"][first_difference or 0:][:12])


def fillers(seed: int, n: int, length: int = 8 * BLOCK_SIZE) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt": [rng.choice(VOCAB) for _ in range(length)], "max_tokens": 1} for _ in range(n)]


@pytest.mark.parametrize("refresh", ["none", "whole", "aborted"])
async def test_a_prompt_only_refresh_keeps_a_context_vllm_would_evict(small_pod: VllmPod, http, refresh: str):
    # A context of 8 full blocks, then 6 others of 8 blocks each: the pod's 47 blocks cannot hold all 7, and
    # its LRU evicts the first. A refresh halfway (the context's blocks plus one token, one token answered)
    # hits all 8 blocks, computes one token, and puts the context at the most recently used end. One the
    # client gives up on once the engine runs it (the gateway cancels a refresh when a client request comes
    # for its pod) has done the same: vLLM aborts it and frees its blocks to the back, as any request's.
    rng = random.Random(11)
    context = [rng.choice(VOCAB) for _ in range(8 * BLOCK_SIZE + 40)]
    await reset(http, small_pod.url)
    await replay_sequence(http, small_pod.url, [{"prompt": context, "max_tokens": 1}])
    others = fillers(seed=12, n=6)
    await replay_sequence(http, small_pod.url, others[:3])
    if refresh == "whole":
        cached = await replay_sequence(http, small_pod.url,
                                       [{"prompt": context[: 8 * BLOCK_SIZE + 1], "max_tokens": 1}])
        assert cached == [8 * BLOCK_SIZE]  # every block hit: the refresh computed one token
    elif refresh == "aborted":
        await aborted_once_running(http, small_pod.url, {"prompt": context[: 8 * BLOCK_SIZE + 1],
                                                         "max_tokens": 100, "ignore_eos": True})
    await replay_sequence(http, small_pod.url, others[3:])
    [back] = await replay_sequence(http, small_pod.url, [{"prompt": context, "max_tokens": 1}])
    assert back == (0 if refresh == "none" else 8 * BLOCK_SIZE)


async def aborted_once_running(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """Send a request, streamed, and close its connection at its first token (the engine runs it, many tokens
    still to go); then wait until the engine let it go. (Polling the engine's running gauge instead missed a
    short request now and then: it had ended before the gauge said it ran.)"""
    async with http.post(f"{url}/v1/completions", json={"model": MODEL, **body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        first = await resp.content.readline()
        assert first.startswith(b"data: {"), first  # a token, not the stream's end
        resp.close()  # the client leaves mid-answer
    for _ in range(200):
        await asyncio.sleep(0.02)
        if await pod_metric(http, url, "vllm:num_requests_running") == 0:
            return
    raise AssertionError("vLLM kept running a request whose client left")


async def workflow_stage(http, gateway_url: str, workflow: str, stage: str, messages: list[dict[str, Any]],
                         **headers: str) -> dict[str, Any]:
    answer, _ = await post(http, f"{gateway_url}/v1/chat/completions",
                           {"model": MODEL, "messages": messages, "max_tokens": 4},
                           {"x-workflow-id": workflow, "x-stage-id": stage, **headers})
    return answer["usage"]


@pytest.mark.parametrize("keep_warm", [True, False])
async def test_the_gateway_keeps_a_thinking_workflow_warm_on_a_real_pod(small_pod: VllmPod, start_gateway, http,
                                                                        model_dir: str, keep_warm: bool):
    # A workflow's context (~8 blocks) thinks while six other clients' one-off requests of ~8 blocks each go
    # through the same pod: its 47 blocks cannot hold them all, and its LRU would evict the workflow first.
    await reset(http, small_pod.url)
    gw = await start_gateway([small_pod.gateway_config()], routing={"policy": "kv_aware"},
                             tokenization={"models": {MODEL: {"path": model_dir}}},
                             load={"scrape_interval_s": 0.2}, placement={"default_think_s": 30.0},
                             workflow={"keep_warm": {"enabled": keep_warm, "max_share": 1.0}})
    rng = random.Random(5)
    words = lambda n: " ".join(str(rng.randrange(10_000)) for _ in range(n))  # noqa: E731
    history = [{"role": "system", "content": words(450)}, {"role": "user", "content": "Step 1."}]
    first = await workflow_stage(http, gw.url, "wf", "s1", history)
    assert 7 * BLOCK_SIZE < first["prompt_tokens"] < 12 * BLOCK_SIZE
    for i in range(6):
        other = await workflow_stage(http, gw.url, f"other-{i}", "s", [{"role": "user", "content": words(450)}],
                                     **{"x-workflow-complete": "true"})
        assert other["prompt_tokens"] > 7 * BLOCK_SIZE
        # Other clients come and go: a refresh takes the pod only while it is idle, and once its scraped
        # metrics (every 0.2 s) no longer show the last request waiting.
        await asyncio.sleep(0.6)
    history.append({"role": "user", "content": "Step 2."})
    second = await workflow_stage(http, gw.url, "wf", "s2", history)
    left = (first["prompt_tokens"] - 16) // BLOCK_SIZE * BLOCK_SIZE  # its blocks the next prompt shares
    if keep_warm:
        # Seen in the pod's own answer: the refreshed context was still cached when its next stage came.
        keep_warm = (await debug_placement(http, gw.url))["keep_warm"]
        # In full (pytest would shorten a dict): what keep-warm saw and did, pod by pod.
        assert second["prompt_tokens_details"]["cached_tokens"] >= left, json.dumps(keep_warm)
    else:
        assert second["prompt_tokens_details"]["cached_tokens"] < 2 * BLOCK_SIZE


async def debug_placement(http, gateway_url: str) -> dict[str, Any]:
    async with http.get(f"{gateway_url}/debug/placement") as resp:
        return await resp.json()
