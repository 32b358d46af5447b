"""The gateway in front of two real vLLM pods: every assertion is checked against what the engine reports.

The pods are shared by the whole module (starting one takes a minute); each test starts its own gateway
(in-process, so it can look into the index) after emptying both pods' caches, and uses text of its own.
The CPU backend caches blocks of 128 tokens, so the prompts here run to several hundred tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import aiohttp
import openai
import pytest

from bench.metrics_text import prediction_checks
from gateway.core.inference_api import parse_inference_request
from gateway.tokenization.hf import HfTokenizer
from tests.conftest import eventually, gateway_process
from tests.e2e.conftest import BLOCK_SIZE, MODEL, VllmFleet

WORDS = ("cache prefix router token block engine agent stage latency pod gateway kernel tensor batch "
         "queue memory request stream replica shard").split()
WAIT_S = 20.0  # for what a real engine does in the background: events, health, the cache controller


def document(name: str, words: int = 400) -> str:
    rng = random.Random(name)
    return f"Document {name}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(doc: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": doc}, {"role": "user", "content": question}]


def full_blocks(token_count: int) -> int:
    """Tokens of a prompt the engine can serve from cache (it always recomputes the last one)."""
    return (token_count - 1) // BLOCK_SIZE * BLOCK_SIZE


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    async with http.post(url, json=body, headers=headers or {}) as resp:
        assert resp.status == 200, (resp.status, await resp.text())
        return await resp.json(), resp.headers


async def chat(http: aiohttp.ClientSession, base_url: str, messages: list[dict[str, Any]],
               headers: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    return await post(http, f"{base_url}/v1/chat/completions",
                      {"model": MODEL, "messages": messages, "max_tokens": 4}, headers)


async def pod_metric(http: aiohttp.ClientSession, pod_url: str, name: str) -> float:
    async with http.get(f"{pod_url}/metrics") as resp:
        text = await resp.text()
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


async def step_engine(http: aiohttp.ClientSession, pod_url: str) -> None:
    """A request too short to fill a block: the engine steps (and publishes queued events), caching nothing."""
    await post(http, f"{pod_url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})


async def prediction_outcomes(http: aiohttp.ClientSession, gateway_url: str) -> tuple[dict[str, float], str]:
    """How the gateway's checks of its predictions against the engines came out, by outcome, and its
    metrics text."""
    async with http.get(f"{gateway_url}/metrics") as resp:
        text = await resp.text()
    checks = prediction_checks(text)
    return {k.removeprefix("prediction_"): v for k, v in checks.items() if k.startswith("prediction_")}, text


@pytest.fixture
async def empty_caches(vllm: VllmFleet, http: aiohttp.ClientSession) -> VllmFleet:
    for pod in vllm.pods:
        body, _ = await post(http, f"{pod.url}/reset_prefix_cache", {})
        assert body.get("success", True), body
        await step_engine(http, pod.url)  # publish the AllBlocksCleared now, before a gateway replays
    return vllm


@pytest.fixture
def start_kv_gateway(start_gateway, empty_caches: VllmFleet, model_dir: str):
    async def start(**overrides: Any):
        overrides.setdefault("routing", {"policy": "kv_aware"})
        overrides.setdefault("health", {"interval_s": 0.3, "timeout_s": 2.0, "failure_threshold": 2})
        tokenization = {"models": {MODEL: {"path": model_dir}}, **overrides.pop("tokenization", {})}
        return await start_gateway(empty_caches.gateway_pods(), tokenization=tokenization, **overrides)
    return start


def confirmed_tokens(gw, pod: str, ids: list[int]) -> int:
    """Prompt tokens the gateway's index holds on ``pod`` from the pod's own events (not speculation)."""
    match = gw.kits.kv.index.lookup(MODEL, None, ids, [pod])[pod]
    return match.gpu_tokens - match.speculative_tokens


async def settled(gw, pod: str, ids: list[int], http: aiohttp.ClientSession, pod_url: str) -> None:
    """Wait until the pod's events for this prompt are in the index."""
    await eventually(lambda: confirmed_tokens(gw, pod, ids) == full_blocks(len(ids)), WAIT_S,
                     nudge=lambda: step_engine(http, pod_url))


def test_openai_sdk_through_a_gateway_process(vllm: VllmFleet, model_dir: str, tmp_path) -> None:
    config = tmp_path / "gateway.json"
    # No block size declared: the pods are fresh, and before their first event only their metrics say it.
    config.write_text(json.dumps({"pods": vllm.gateway_pods(), "routing": {"policy": "kv_aware"},
                                  "tokenization": {"models": {MODEL: {"path": model_dir}}}}))
    tokenizer = HfTokenizer(model_dir)
    messages = conversation(document("sdk"), "What is in the document?")
    prompt = document("sdk-completion", 200)
    extra = {"ignore_eos": True}  # random weights may pick EOS at once; usage must still add up
    with gateway_process("--config", str(config)) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]

        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=5,
                                                               extra_body=extra)
        reply = raw.parse()
        assert raw.headers["x-gateway-pod"] in ("vllm0", "vllm1")
        assert isinstance(reply.choices[0].message.content, str)
        assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
        assert reply.usage.completion_tokens == 5 and reply.usage.total_tokens == reply.usage.prompt_tokens + 5

        streamed_raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True},
            extra_body=extra)
        chunks = list(streamed_raw.parse())
        assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == 5
        # The same prompt again: the gateway sends it where the first one left its blocks.
        routes = [(r.headers["x-gateway-pod"], r.headers["x-gateway-prefix-tokens"]) for r in (raw, streamed_raw)]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full_blocks(reply.usage.prompt_tokens), routes
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 1

        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_body=extra)
        assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert completion.usage.completion_tokens == 3
        streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, stream=True,
                                                  stream_options={"include_usage": True}, extra_body=extra))
        assert streamed[-1].usage.prompt_tokens == completion.usage.prompt_tokens
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        # vLLM merges a stream's deltas when its reader lags behind the engine (RequestOutputCollector): one
        # to three chunks carry the three tokens, and the final usage counts them.
        assert isinstance(text, str) and 1 <= len([c for c in streamed if c.choices]) <= 3
        assert streamed[-1].usage.completion_tokens == 3
    assert gw.proc.returncode == 0


@pytest.mark.parametrize("fast_bpe", [False, True])
async def test_local_tokenization_equals_the_pods_tokenize(start_kv_gateway, vllm: VllmFleet, http,
                                                           fast_bpe: bool) -> None:
    gw = await start_kv_gateway(tokenization={"fast_bpe": fast_bpe})
    # With tokenization.fast_bpe the text between added tokens is encoded through tiktoken, the engine's
    # through the Rust tokenizer: the ids must still be the engine's.
    assert gw.kits.tokens.tokens.local(MODEL).tokenizer.fast_bpe is fast_bpe
    doc = document("tokenize", 120)
    chats = [
        [{"role": "user", "content": "Hello there"}],
        conversation(doc, "  Summarise it, please.\n"),
        [*conversation(doc, "First?"), {"role": "assistant", "content": "It is about caches."},
         {"role": "user", "content": "Zweite Frage: was ist mit Blöcken? 🚀"}],
        [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]}],
    ]
    for messages in chats:
        body = {"model": MODEL, "messages": messages}
        local = await gw.kits.tokens.tokens.tokenize(MODEL, "chat", parse_inference_request(json.dumps(body).encode()))
        remote, _ = await post(http, f"{vllm[0].url}/tokenize", {**body, "add_generation_prompt": True})
        assert list(local.ids) == remote["tokens"], messages
    for prompt in ("Hello", doc, "tabs\tand\nnewlines  ", "<|eot_id|> special text", "ünïcödé ✓"):
        body = {"model": MODEL, "prompt": prompt}
        local = await gw.kits.tokens.tokens.tokenize(MODEL, "completion",
                                                 parse_inference_request(json.dumps(body).encode()))
        remote, _ = await post(http, f"{vllm[1].url}/tokenize", body)
        assert list(local.ids) == remote["tokens"], prompt


async def test_index_predicts_each_pods_cached_tokens_request_by_request(start_kv_gateway, vllm: VllmFleet,
                                                                          http) -> None:
    gw = await start_kv_gateway()
    tokens = gw.kits.tokens.tokens.local(MODEL).tokenizer
    urls = {p.name: p.url for p in vllm.pods}
    rng = random.Random(3)
    history: dict[str, list[dict[str, Any]]] = {}
    hits = 0
    for i in range(14):
        name = f"predict-{rng.randrange(3)}"
        # Conversations grow turn by turn: each request extends a prefix one of the pods already holds.
        messages = history.get(name) or conversation(document(name), "Start.")
        messages = messages + ([{"role": "assistant", "content": f"Answer {i}."},
                                {"role": "user", "content": f"Follow-up {i}: " + document(f"{name}-{i}", 60)}]
                               if name in history else [])
        pod_hits_before = {p: await pod_metric(http, url, "vllm:prefix_cache_hits_total") for p, url in urls.items()}
        reply, headers = await chat(http, gw.url, messages)
        pod, predicted = headers["x-gateway-pod"], int(headers["x-gateway-prefix-tokens"])
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert predicted == cached, (i, pod, predicted, cached)
        assert await pod_metric(http, urls[pod], "vllm:prefix_cache_hits_total") - pod_hits_before[pod] == cached
        hits += cached > 0
        history[name] = messages
        await settled(gw, pod, tokens.encode_chat(messages), http, urls[pod])
    assert hits >= 8
    # The gateway checked each answer itself: every one agreed with the engine, and nothing drifted.
    outcomes, text = await prediction_outcomes(http, gw.url)
    assert outcomes["exact"] == 14 and set(outcomes) == {"exact"}, outcomes
    assert f'gateway_kv_drift{{model="{MODEL}"}} 1.0' not in text


async def test_kv_aware_sends_a_shared_prefix_to_the_pod_holding_it(start_kv_gateway, vllm: VllmFleet,
                                                                     http) -> None:
    gw = await start_kv_gateway()
    tokens = gw.kits.tokens.tokens.local(MODEL).tokenizer
    docs = {"vllm0": document("holder-b"), "vllm1": document("holder-a")}
    # Each document goes straight to one pod, past the gateway: only that pod's events can tell.
    for pod, doc in docs.items():
        messages = conversation(doc, "Warm up.")
        await chat(http, vllm[int(pod[-1])].url, messages)
        await settled(gw, pod, tokens.encode_chat(messages), http, vllm[int(pod[-1])].url)
    for i in range(6):
        holder = ("vllm1", "vllm0")[i % 2]
        messages = conversation(docs[holder], f"Question {i} about it?")
        shared = full_blocks(len(tokens.encode_chat(conversation(docs[holder], ""))))
        reply, headers = await chat(http, gw.url, messages)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert headers["x-gateway-pod"] == holder, (i, dict(headers))
        assert cached >= shared > 0 and int(headers["x-gateway-prefix-tokens"]) == cached
    async with http.get(f"{gw.url}/metrics") as resp:
        assert 'gateway_routing_decisions_total{policy="kv_aware",reason="cache_hit"} 6.0' in await resp.text()


async def test_reset_through_the_vllm_controller_empties_the_index_by_the_pods_event(start_kv_gateway,
                                                                                    vllm: VllmFleet, http) -> None:
    gw = await start_kv_gateway(workflow={"hard_flush": True})  # a completed workflow's pod is flushed
    messages = conversation(document("flush"), "Stage one.")
    headers = {"x-workflow-id": "wf-flush", "x-stage-id": "one"}
    _, resp_headers = await chat(http, gw.url, messages, headers)
    pod = resp_headers["x-gateway-pod"]
    url = vllm[int(pod[-1])].url
    ids = gw.kits.tokens.tokens.local(MODEL).tokenizer.encode_chat(messages)
    await settled(gw, pod, ids, http, url)
    index = gw.kits.kv.index
    assert index.blocks_on(pod) >= full_blocks(len(ids)) // BLOCK_SIZE
    clears = index.stats.clears

    async with http.post(f"{gw.url}/v1/workflows/wf-flush/complete", json={}) as resp:
        assert resp.status == 200, await resp.text()
        actions = (await resp.json())["actions"]
    assert any(a["pod"] == pod and a["action"] == "flush" for a in actions), actions
    executor = gw.kits.workflows.service.executor
    await eventually(lambda: executor.hard_flushes.get(pod, 0) == 1, WAIT_S)
    # The engine queues AllBlocksCleared and publishes it with its next step.
    await eventually(lambda: index.blocks_on(pod) == 0 and index.stats.clears > clears, WAIT_S,
                     nudge=lambda: step_engine(http, url))
    again, _ = await chat(http, url, messages)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the pod agrees: nothing cached


async def test_killed_pod_fails_over_is_forgotten_and_is_rebuilt_after_restart(start_kv_gateway, vllm: VllmFleet,
                                                                               http) -> None:
    gw = await start_kv_gateway()
    tokens = gw.kits.tokens.tokens.local(MODEL).tokenizer
    victim, survivor = vllm[1], vllm[0]
    index = gw.kits.kv.index
    subscriber = next(s for s in gw.kits.kv.events.subscribers() if s.view.pod == victim.name)
    warm = [conversation(document(f"victim-{i}"), "Warm up.") for i in range(3)]
    for messages in warm:  # one event batch each: the restarted engine's seq must run backwards
        await chat(http, victim.url, messages)
        await settled(gw, victim.name, tokens.encode_chat(messages), http, victim.url)
    doc, ids = warm[-1][0]["content"], tokens.encode_chat(warm[-1])
    seq_before, restarts = subscriber.view.last_seq, subscriber.stats.restarts
    assert seq_before >= 3

    victim.kill()
    for i in range(4):  # the index still points at the victim for the first ones: retried on the survivor
        reply, headers = await chat(http, gw.url, conversation(doc, f"After the crash {i}?"))
        assert headers["x-gateway-pod"] == survivor.name
    pod = gw.kits.foundation.pods.get(victim.name)
    await eventually(lambda: not pod.healthy, WAIT_S)
    assert index.blocks_on(victim.name) == 0  # dropped with the pod, before any event could say so

    victim.start()
    await asyncio.to_thread(victim.wait_ready)
    await eventually(lambda: pod.healthy, within_s=30)
    fresh = conversation(document("reborn"), "First words after the restart.")
    await chat(http, victim.url, fresh)
    fresh_ids = tokens.encode_chat(fresh)
    await settled(gw, victim.name, fresh_ids, http, victim.url)
    # The subscriber reconnects up to 5 s (ZMQ's backoff) after the new engine binds, so the fresh batch may
    # come by the catch-up replay, which applies each batch as it arrives and tells a restart from a return
    # only at the replay's end: wait for that verdict rather than read it in the middle.
    await eventually(lambda: subscriber.stats.restarts > restarts, WAIT_S)
    assert subscriber.stats.restarts == restarts + 1 and subscriber.view.last_seq < seq_before
    assert confirmed_tokens(gw, victim.name, ids) == 0  # nothing of the old engine's cache survives
    reply, headers = await chat(http, gw.url, [*fresh[:1], {"role": "user", "content": "And a question."}])
    assert headers["x-gateway-pod"] == victim.name
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(headers["x-gateway-prefix-tokens"]) == cached


async def test_anthropic_messages_are_tokenized_like_vllm_renders_them(start_kv_gateway, vllm: VllmFleet,
                                                                      http) -> None:
    """vLLM's own /v1/messages, through the gateway with the official SDK: the gateway's token count of
    each request is the engine's, the shared system prompt is found where it is cached, and every
    prediction checks out."""
    import anthropic

    gw = await start_kv_gateway()
    sdk = anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0)
    tokens = gw.kits.tokens.tokens.local(MODEL).tokenizer
    urls = {p.name: p.url for p in vllm.pods}
    system = [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},  # vLLM drops it, so must we
              {"type": "text", "text": document("anthropic")}]
    hits = 0
    for i in range(4):
        messages = [{"role": "user", "content": f"Question {i}?"},
                    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}]},
                    {"role": "user", "content": [{"type": "text", "text": f"Go on, {i}."}]}]
        raw = await sdk.messages.with_raw_response.create(model=MODEL, max_tokens=4, system=system,
                                                         messages=messages)
        message = await raw.parse()
        usage, pod = message.usage, raw.headers["x-gateway-pod"]
        cached = usage.cache_read_input_tokens or 0
        ids = tokens.encode_chat([{"role": "system", "content": document("anthropic")}, messages[0],
                                  {"role": "assistant", "content": "Let me look."},
                                  {"role": "user", "content": f"Go on, {i}."}])
        # The engine rendered exactly what the gateway did (Anthropic splits the prompt three ways).
        assert usage.input_tokens + cached + (usage.cache_creation_input_tokens or 0) == len(ids)
        assert int(raw.headers["x-gateway-prefix-tokens"]) == cached
        hits += cached > 0
        await settled(gw, pod, ids, http, urls[pod])
    assert hits >= 3
    outcomes, _ = await prediction_outcomes(http, gw.url)
    assert outcomes == {"exact": 4}, outcomes
    counted = await sdk.messages.count_tokens(model=MODEL, system=system, messages=messages)
    assert counted.input_tokens == len(ids)  # vLLM's own count, relayed
