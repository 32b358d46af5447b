"""A simulated pod over real sockets: HTTP API shapes, KV events on ZMQ, replay, faults."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import openai
import pytest
import zmq
import zmq.asyncio

from gateway.kv.events import END_OF_REPLAY_SEQ, Encoding, decode_seq, encode_seq


# The subscriber's own view of the wire format, decoded by field name as a peer would. vLLM's hashes
# are digests (bytes; /debug/blocks shows them in hex), older engines' and SGLang's are ints.
class Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]


def shown(hashes: list[int | bytes]) -> list[int | str]:
    return [h.hex() if isinstance(h, bytes) else h for h in hashes]


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    dp_rank: int | None = None


decode_batch = msgspec.msgpack.Decoder(Batch).decode


class Subscriber:
    """Keeps a multiset of the block hashes a pod holds, from its live events."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.held: Counter = Counter()
        self.last_seq = -1

    async def drain_until(self, seq: int) -> None:
        while self.last_seq < seq:
            _topic, seq_frame, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout=5)
            self.last_seq = decode_seq(seq_frame)
            for event in decode_batch(payload).events:
                if isinstance(event, Stored):
                    assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                    self.held.update(shown(event.block_hashes))
                elif isinstance(event, Removed):
                    self.held.subtract(shown(event.block_hashes))
                else:
                    self.held.clear()
        self.held = +self.held

    def close(self) -> None:
        self.sock.close(linger=0)


async def blocks_of(http, pod) -> Counter:
    async with http.get(f"{pod.url}/debug/blocks") as resp:
        return Counter(b["hash"] for b in (await resp.json())["blocks"])


async def chat(http, pod, content: str, max_tokens: int = 3, **extra) -> dict:
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            **extra}
    async with http.post(f"{pod.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_events_describe_exactly_the_blocks_the_cache_holds(start_mock_pod, http):
    pod = await start_mock_pod(block_size=4, num_blocks=40)
    sub = Subscriber(pod.publisher.endpoint)
    await asyncio.sleep(0.3)  # let the subscription reach the publisher (ZMQ slow joiner)
    try:
        texts = [f"Story number {i}: " + "once upon a time " * (3 + i) for i in range(8)]
        for text in texts + texts[:2]:  # enough distinct prompts to force evictions, then repeats
            await chat(http, pod, text)
            await sub.drain_until(pod.publisher.seq - 1)
            assert sub.held == await blocks_of(http, pod)
        assert pod.engine.cache.stats.evictions > 0
        repeat = await chat(http, pod, texts[1])
        assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        async with http.post(f"{pod.url}/reset_prefix_cache") as resp:
            assert (await resp.json()) == {"success": True}
        await sub.drain_until(pod.publisher.seq - 1)
        assert sub.held == Counter() == await blocks_of(http, pod)
        assert sub.last_seq == pod.publisher.seq - 1 and sub.last_seq > 10
    finally:
        sub.close()


async def replay(endpoint: str, start: int) -> list[list[bytes]]:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", encode_seq(start)])
        messages = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout=5)
            messages.append(frames)
            if END_OF_REPLAY_SEQ in frames:
                return messages
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize(("encoding", "frames"), [(Encoding.CURRENT, 4), (Encoding.V0_25, 3)])
async def test_replay_returns_buffered_batches_then_end_marker(start_mock_pod, http, encoding, frames):
    pod = await start_mock_pod(encoding=encoding, topic="kv")
    for i in range(3):
        await chat(http, pod, f"replay me {i} " * 10)
    last = pod.publisher.seq - 1
    messages = await replay(pod.publisher.replay_endpoint, 1)
    *batches, end = messages
    assert all(len(m) == frames and m[0] == b"" for m in messages)
    assert [decode_seq(m[-2]) for m in batches] == list(range(1, last + 1))
    if encoding is Encoding.CURRENT:
        assert all(m[1] == b"kv" for m in batches) and end == [b"", b"", END_OF_REPLAY_SEQ, b""]
    else:
        assert end == [b"", END_OF_REPLAY_SEQ, b""]
    assert all(decode_batch(m[-1]).events for m in batches)


async def test_legacy_encoding_sends_tagged_arrays(start_mock_pod, http):
    pod = await start_mock_pod(encoding=Encoding.V0_23)
    await chat(http, pod, "legacy " * 20)
    first, *_ = await replay(pod.publisher.replay_endpoint, 0)
    assert len(first) == 3  # [b"", seq, payload]: no topic frame before 0.26
    batch = msgspec.msgpack.decode(first[-1])
    assert len(batch) == 2  # [ts, events]: no rank slot in old releases
    event = batch[1][0]
    assert event[0] == "BlockStored" and isinstance(event[1], list) and event[2] is None
    assert len(event[3]) == len(event[1]) * event[4]


async def test_openai_sdk_against_the_pod(start_mock_pod, tokenizer):
    pod = await start_mock_pod(lora_adapters=["sql-lora"])
    client = openai.AsyncOpenAI(base_url=f"{pod.url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    first = await client.chat.completions.create(model="mock-llama", messages=messages, max_tokens=4)
    assert first.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    stream = await client.chat.completions.create(model="mock-llama", messages=messages, max_tokens=4,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16
    models = await client.models.list()
    assert [(m.id, getattr(m, "parent", None)) for m in models.data] == [("mock-llama", None),
                                                                          ("sql-lora", "mock-llama")]
    await client.close()


async def test_tokenize_and_render_match_the_tokenizer(start_mock_pod, http, tokenizer):
    pod = await start_mock_pod()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    async with http.post(f"{pod.url}/tokenize", json={"model": "mock-llama", "messages": messages}) as resp:
        body = await resp.json()
    assert body["tokens"] == tokenizer.encode_chat(messages) and body["count"] == len(body["tokens"])
    async with http.post(f"{pod.url}/tokenize", json={"model": "mock-llama", "prompt": "Hi!"}) as resp:
        assert (await resp.json())["tokens"] == tokenizer.encode("Hi!")
    async with http.post(f"{pod.url}/v1/chat/completions/render",
                         json={"model": "mock-llama", "messages": messages}) as resp:
        assert (await resp.json())["token_ids"] == tokenizer.encode_chat(messages)
    render = {"model": "mock-llama", "prompt": ["a", "b"]}
    async with http.post(f"{pod.url}/v1/completions/render", json=render) as resp:
        rendered = await resp.json()
    assert [r["token_ids"] for r in rendered] == [tokenizer.encode("a"), tokenizer.encode("b")]


async def test_vllm_metrics_names_and_values(start_mock_pod, http):
    pod = await start_mock_pod(block_size=8)
    for _ in range(2):
        await chat(http, pod, "metrics " * 30)
    text = await (await http.get(f"{pod.url}/metrics")).text()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()}
    queries, hits = values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]
    # Two identical prompts: the second hits every full block but the one holding the last token.
    prompt_tokens = pod.engine.prompt_tokens_total // 2
    assert queries == 2 * prompt_tokens and hits == (prompt_tokens - 1) // 8 * 8
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0  # nothing running: every block is free (if cached)
    assert 'block_size="8"' in text and "vllm:cache_config_info" in values


async def test_sglang_flavour(start_mock_pod, http):
    pod = await start_mock_pod(flavor="sglang", speed=1.0)
    info = await (await http.get(f"{pod.url}/server_info")).json()
    assert info["kv_events"]["port"] == int(pod.publisher.endpoint.rsplit(":", 1)[1])
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "x " * 50}], "max_tokens": 500,
            "stream": True}
    resp = await http.post(f"{pod.url}/v1/chat/completions", json=body)
    await resp.content.readany()
    async with http.post(f"{pod.url}/flush_cache") as refused:
        assert refused.status == 200 and "not flushed" in await refused.text()
    resp.close()
    for _ in range(100):
        if not pod.engine.running:
            break
        await asyncio.sleep(0.02)
    async with http.post(f"{pod.url}/flush_cache") as flushed:
        assert "Cache flushed" in await flushed.text()
    text = await (await http.get(f"{pod.url}/metrics")).text()
    assert "sglang:num_running_reqs" in text and "sglang:cache_hit_rate" in text and "vllm:" not in text
    async with http.post(f"{pod.url}/reset_prefix_cache") as resp:
        assert resp.status == 404


async def test_sglang_hashes_are_signed_int64(start_mock_pod, http):
    pod = await start_mock_pod(flavor="sglang", block_size=4)
    for i in range(6):
        await chat(http, pod, f"signed {i} " * 20)
    hashes = list(await blocks_of(http, pod))
    assert all(-(2**63) <= h < 2**63 for h in hashes) and any(h < 0 for h in hashes)


async def test_faults_errors_restart_and_dropped_batches(start_mock_pod, http):
    pod = await start_mock_pod()
    sub = Subscriber(pod.publisher.endpoint)
    await asyncio.sleep(0.3)
    try:
        async with http.post(f"{pod.url}/debug/faults", json={"drop_event_fraction": 1.0}) as resp:
            assert resp.status == 200
        await chat(http, pod, "lost in transit " * 10)
        assert pod.publisher.batches_dropped >= 1
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sub.sock.recv_multipart(), timeout=0.3)
        messages = await replay(pod.publisher.replay_endpoint, 0)  # still replayable
        assert len(messages) == pod.publisher.seq + 1
        async with http.post(f"{pod.url}/debug/faults", json={"error_fraction": 1.0}) as resp:
            assert resp.status == 200
        async with http.post(f"{pod.url}/v1/chat/completions", json={"model": "mock-llama", "messages": [
                {"role": "user", "content": "x"}]}) as resp:
            assert resp.status == 500
        async with http.post(f"{pod.url}/debug/faults", json={"restart": True}) as resp:
            assert resp.status == 200
        assert pod.publisher.seq == 0 and await blocks_of(http, pod) == Counter()
        await chat(http, pod, "after restart " * 10)
        _topic, seq, _payload = await asyncio.wait_for(sub.sock.recv_multipart(), timeout=5)
        assert decode_seq(seq) == 0  # seq back to 0 tells subscribers the engine restarted
        async with http.post(f"{pod.url}/debug/faults", json={"bogus": 1}) as resp:
            assert resp.status == 400
    finally:
        sub.close()


async def test_die_mid_stream_cuts_the_connection(start_mock_pod, http):
    import aiohttp

    pod = await start_mock_pod()
    await http.post(f"{pod.url}/debug/faults", json={"die_mid_stream_fraction": 1.0})
    body = {"model": "mock-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50,
            "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{pod.url}/v1/chat/completions", json=body) as resp:
            await resp.read()
