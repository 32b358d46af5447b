"""KV-aware routing end to end: a gateway in front of 4 simulated vLLM pods with KV events."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import msgspec
import pytest

from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from tests.integration.test_kv_subscriber import eventually

MODEL = "mock-llama"


async def fleet(start_mock_pod, start_gateway, n=4, pod_kw=None, **gateway_kw):
    pods = [await start_mock_pod(**(pod_kw or {})) for _ in range(n)]
    gateway_kw.setdefault("tokenization", {"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}})
    gateway_kw.setdefault("routing", {"policy": "kv_aware"})
    gw = await start_gateway([msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"} for i, p in enumerate(pods)],
                             **gateway_kw)
    return pods, gw


async def synced(gw, pods) -> None:
    """Wait until the gateway has applied every event batch each pod has published."""
    index = gw.kits.kv.index
    await eventually(lambda: all(
        index.view(f"pod{i}", 0, MODEL).last_seq == p.publisher.seq - 1 for i, p in enumerate(pods)), within_s=15)


def system_prompt(group: int) -> str:
    rng = random.Random(group)
    words = ["cache", "prefix", "router", "token", "block", "engine", "agent", "stage", "latency", "pod"]
    return f"Group {group}. " + " ".join(rng.choice(words) for _ in range(500))


async def ask(http, gw, group: int, question: str, max_tokens: int = 4, **headers):
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": system_prompt(group)}, {"role": "user", "content": question}]}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
        return resp.headers["x-gateway-pod"], int(resp.headers["x-gateway-prefix-tokens"]), usage


async def test_shared_prefix_follows_its_pod_and_predictions_are_exact(start_mock_pod, start_gateway, http,
                                                                         tokenizer):
    # Small caches (100 blocks of 16 tokens per pod) for 16 groups of ~530 tokens: evictions happen.
    pods, gw = await fleet(start_mock_pod, start_gateway, pod_kw={"num_blocks": 100},
                           kv_index={"speculative_ttl_s": 0})
    rng = random.Random(7)
    best_hits = 0
    for i in range(80):
        group, question = rng.randrange(16), f"Question {i}?"
        ids = tokenizer.encode_chat([{"role": "system", "content": system_prompt(group)},
                                     {"role": "user", "content": question}])
        # What each pod's own cache would give this prompt right now.
        possible = {f"pod{k}": len(p.engine.cache.cached_prefix(
            p.engine.cache.chain_hashes(ids)[: (len(ids) - 1) // 16])) * 16 for k, p in enumerate(pods)}
        pod, predicted, usage = await ask(http, gw, group, question)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert predicted == cached, (i, pod, predicted, cached)
        assert cached == max(possible.values()), (i, pod, possible)  # the pod holding the most of it
        best_hits += cached > 0
        await synced(gw, pods)
    assert best_hits >= 25
    assert sum(p.engine.cache.stats.evictions for p in pods) > 0
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_routing_decisions_total{policy="kv_aware",reason="cache_hit"}' in metrics


async def test_burst_with_one_new_prefix_follows_the_first_request(start_mock_pod, start_gateway, http):
    _, gw = await fleet(start_mock_pod, start_gateway, pod_kw={"speed": 0.05})
    results = await asyncio.gather(*(ask(http, gw, 99, f"burst {i}") for i in range(8)))
    chosen = Counter(pod for pod, _, _ in results)
    # Speculative insertion: the burst lands where the first one went, before any event came back.
    assert len(chosen) == 1


async def test_before_any_event_the_block_size_comes_from_the_engines_metrics(start_mock_pod, start_gateway, http):
    """Pods that declare no block size and whose events are all lost in transit: their engines'
    ``cache_config_info`` says how they cut prompts, so the first request's blocks count as routed and the
    same prompt again goes where they are (without it nothing is matched or expected before an event)."""
    pods = [await start_mock_pod() for _ in range(2)]
    for pod in pods:
        async with http.post(f"{pod.url}/debug/faults", json={"drop_event_fraction": 1.0}) as resp:
            assert resp.status == 200
    gw = await start_gateway([msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}", "block_size": None}
                              for i, p in enumerate(pods)],
                             tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
                             routing={"policy": "kv_aware"})
    index = gw.kits.kv.index
    assert [index.block_size(f"pod{i}") for i in range(2)] == [16, 16]
    assert all(view.block_size is None and view.last_seq == -1 for view in index.views())  # no event said it
    first_pod, _, _ = await ask(http, gw, 21, "Same question?")
    pod, predicted, usage = await ask(http, gw, 21, "Same question?")
    assert pod == first_pod and predicted == usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_hot_prefix_is_rebalanced_when_its_pod_is_overloaded(start_mock_pod, start_gateway, http):
    pods, gw = await fleet(start_mock_pod, start_gateway, pod_kw={"speed": 0.2},
                           routing={"policy": "kv_aware", "options": {"kv_aware": {"overload_slack": 2}}})
    await ask(http, gw, 5, "warm-up")
    await synced(gw, pods)
    results = await asyncio.gather(*(ask(http, gw, 5, f"hot {i}", max_tokens=64) for i in range(12)))
    chosen = Counter(pod for pod, _, _ in results)
    assert len(chosen) > 1 and max(chosen.values()) < 12
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'reason="rebalanced"' in metrics and 'reason="cache_hit"' in metrics


async def test_model_without_tokenizer_routes_approximately(start_mock_pod, start_gateway, http):
    _, gw = await fleet(start_mock_pod, start_gateway, tokenization={"default_mode": "none"})
    first, _, _ = await ask(http, gw, 1, "one")
    for i in range(4):
        pod, _, usage = await ask(http, gw, 1, f"again {i}")
        assert pod == first and usage["prompt_tokens_details"]["cached_tokens"] > 0
    metrics = await (await http.get(f"{gw.url}/metrics")).text()
    assert 'gateway_routing_decisions_total{policy="kv_aware",reason="approximate"} 5.0' in metrics
    assert 'gateway_tokenization_total{mode="none",model="mock-llama",outcome="unavailable"} 5.0' in metrics


async def test_remote_tokenization_routes_precisely(start_mock_pod, start_gateway, http):
    pods, gw = await fleet(start_mock_pod, start_gateway, tokenization={"default_mode": "remote"},
                           kv_index={"speculative_ttl_s": 0})
    first, _, _ = await ask(http, gw, 3, "one")
    await synced(gw, pods)
    pod, predicted, usage = await ask(http, gw, 3, "two")
    assert pod == first and predicted == usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_index_converges_after_lost_batches_and_a_restart(start_mock_pod, start_gateway, http):
    pods, gw = await fleet(start_mock_pod, start_gateway, pod_kw={"num_blocks": 200})
    for k, p in enumerate(pods):
        p.publisher.drop_fraction = 0.05
        p.publisher.rng = random.Random(k)  # some batches are lost, the same ones every run
    rng = random.Random(3)
    restarted = 0
    for i in range(80):
        await ask(http, gw, rng.randrange(12), f"chaos {i}")
        if i == 40:  # the busiest engine dies and comes back empty, seq from 0
            restarted = max(range(4), key=lambda k: len(pods[k].engine.cache.cached_blocks()))
            pods[restarted].restart()
    for p in pods:
        p.publisher.drop_fraction = 0.0
    for group in range(12):  # fresh batches reveal any trailing gap, which replay then fills
        await ask(http, gw, group, "settle")
    await synced(gw, pods)

    async def truth(i: int) -> set[int]:
        async with http.get(f"{pods[i].url}/debug/blocks") as resp:
            return {b["token_hash"] for b in (await resp.json())["blocks"]}

    index = gw.kits.kv.index
    for i in range(4):
        assert index.own_hashes(f"pod{i}") == await truth(i), f"pod{i}"
    debug = await (await http.get(f"{gw.url}/debug/index")).json()
    stats = {v["pod"]: v["subscriber"] for v in debug["views"]}
    assert sum(s["gaps"] for s in stats.values()) > 0 and stats[f"pod{restarted}"]["restarts"] == 1
    assert not any(v["approximate"] for v in debug["views"])


async def test_restarted_gateway_rebuilds_its_index_from_replay(start_mock_pod, start_gateway, http):
    pods, first = await fleet(start_mock_pod, start_gateway, n=2, kv_index={"speculative_ttl_s": 0})
    pod, _, _ = await ask(http, first, 4, "before the restart")
    await synced(first, pods)
    await first.runner.cleanup()  # the gateway goes away; the pods keep their caches
    second = await start_gateway([msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"}
                                  for i, p in enumerate(pods)],
                                 tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
                                 routing={"policy": "kv_aware"}, kv_index={"speculative_ttl_s": 0})
    await synced(second, pods)  # from the pods' replay buffers, before any new event
    routed, predicted, usage = await ask(http, second, 4, "after the restart")
    assert routed == pod and predicted == usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("defer", [True, False])
async def test_a_conversations_next_turns_stay_with_its_cache_whether_tokenized_before_or_after(
        start_mock_pod, start_gateway, http, tokenizer, defer):
    # defer: each next turn is routed on its earlier prompt and its new messages tokenized once answered.
    pods, gw = await fleet(start_mock_pod, start_gateway, n=3, kv_index={"speculative_ttl_s": 0},
                           tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}},
                                         "defer_new_text": defer})
    messages = [{"role": "system", "content": system_prompt(5)}, {"role": "user", "content": "Summarise it."}]
    chosen, working_set, index, prompted = [], gw.kits.kv.working_set, gw.kits.kv.index, 0
    for turn in range(4):
        async with http.post(f"{gw.url}/v1/chat/completions",
                             json={"model": MODEL, "max_tokens": 6, "messages": messages}) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
            pod, predicted = resp.headers["x-gateway-pod"], int(resp.headers["x-gateway-prefix-tokens"])
        whole = tokenizer.encode_chat(messages)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert answer["usage"]["prompt_tokens"] == len(whole)
        chosen.append(pod)
        prompted += len(whole)
        if turn:  # every block predicted was there; routed on its earlier prompt's head, only the head's
            assert 0 < predicted <= cached and (defer or predicted == cached), (turn, predicted, cached)
        # Once answered, the conversation's context holds the whole prompt: its next turn is recognised by it.
        context = working_set.continued(index.prompt_hashes(MODEL, None, whole).full(16))
        assert context is not None and context.stages == turn + 1 and working_set.size == 1
        await synced(gw, pods)
        messages = [*messages, answer["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
    assert len(set(chosen)) == 1, chosen
    registry = gw.kits.foundation.metrics.registry
    reused, new = (registry.get_sample_value("gateway_prompt_tokens_reused_total", {"model": MODEL, "source": source})
                   for source in ("reused", "new"))
    assert reused and new and reused + new == prompted  # every turn counted once, the next turns mostly reused
    for outcome in ("prompt_tokens_mismatch", "over"):  # the whole prompt's count is the engine's
        assert not registry.get_sample_value("gateway_kv_prediction_exact_total",
                                             {"model": MODEL, "pod": chosen[0], "outcome": outcome})
