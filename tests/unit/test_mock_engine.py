"""The simulated engine and its paged KV cache behave like vLLM's where routing depends on it."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from simulator.engine import EngineLimits, LoraSlots, MockEngine, PromptRejected, TimingModel
from simulator.kvcache import LoraKey, PagedKvCache

OUTPUT = [900, 901, 902, 903, 904]


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, **limits) -> None:
        self.batches: list[list] = []
        self.cache = PagedKvCache(num_blocks, block_size)
        self.engine = MockEngine(self.cache, OUTPUT, self.batches.append, TimingModel(speed=0.0),
                                 EngineLimits(**limits) if limits else None)

    @property
    def events(self) -> list:
        return [e for batch in self.batches for e in batch]

    async def run(self, prompt: list[int], max_tokens: int = 2):
        seq = self.engine.submit(prompt, max_tokens)
        return seq, await drain(seq)


async def drain(seq) -> list[int]:
    return [t async for t in seq.tokens()]


@pytest.fixture
async def harness():
    h = Harness()
    h.engine.start()
    yield h
    await h.engine.stop()


async def test_hits_are_whole_blocks_and_never_the_last_token(harness):
    prompt = list(range(1, 11))  # 10 tokens, block size 4
    seq, tokens = await harness.run(prompt)
    assert seq.cached_tokens == 0 and tokens == OUTPUT[:2]
    seq, _ = await harness.run(prompt)
    assert seq.cached_tokens == 8
    seq, _ = await harness.run(prompt[:8])  # the 2nd block holds the last token: only 1 block can hit
    assert seq.cached_tokens == 4
    seq, _ = await harness.run([99, *prompt[1:]])  # a different first token breaks the whole chain
    assert seq.cached_tokens == 0
    assert harness.cache.stats.queries == 10 + 10 + 8 + 10 and harness.cache.stats.hits == 12


async def test_block_stored_events_chain_and_carry_tokens(harness):
    await harness.run(list(range(1, 10)), max_tokens=4)  # 9 prompt + 3 computed outputs = 12 tokens
    stored = [e for e in harness.events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 2
    assert stored[0].token_ids == list(range(1, 9)) and stored[0].block_size == 4
    # The third block fills during decode (prompt token 9 + outputs) and chains to the second.
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[1].token_ids == [9, *OUTPUT[:3]]
    held = Counter(b.block_hash for b in harness.cache.cached_blocks())
    assert held == Counter(h for e in stored for h in e.block_hashes)


async def test_identical_prompts_in_one_step_share_the_blocks_the_first_caches_as_it_is_scheduled():
    # vLLM caches a prefill chunk's full blocks when it schedules the chunk, so the same prompt admitted after
    # it in the same step finds them (seen on vLLM 0.32: of three identical prompts sent at once, one computed
    # its blocks and two found them cached).
    h = Harness()
    prompt = list(range(1, 10))
    first, second = h.engine.submit(prompt, 1), h.engine.submit(prompt, 1)
    h.engine.start()
    try:
        await asyncio.gather(drain(first), drain(second))
    finally:
        await h.engine.stop()
    assert first.cached_tokens == 0 and second.cached_tokens == 8
    stored = [e for e in h.events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and Counter(b.block_hash for b in h.cache.cached_blocks()) == Counter(
        stored[0].block_hashes)


async def test_a_prompt_recomputing_its_last_full_block_caches_a_second_copy():
    # A block-aligned prompt cached whole still recomputes its last token, so its last block: vLLM caches that
    # block again under the same hash and announces it (it does not deduplicate physical blocks).
    h = Harness()
    prompt = list(range(1, 9))  # two full blocks of 4
    h.engine.start()
    try:
        await h.run(prompt, max_tokens=1)
        await h.run(prompt, max_tokens=1)
    finally:
        await h.engine.stop()
    stored = [e for e in h.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2, 1] and stored[1].block_hashes == stored[0].block_hashes[1:]
    assert Counter(b.block_hash for b in h.cache.cached_blocks())[stored[0].block_hashes[1]] == 2


async def test_lru_eviction_announces_removed_blocks():
    h = Harness(num_blocks=6, block_size=4)
    h.engine.start()
    try:
        await h.run(list(range(1, 10)), max_tokens=1)  # 3 blocks, 2 of them full and cached
        await h.run(list(range(100, 117)), max_tokens=1)  # 5 blocks: must reuse cached slots
    finally:
        await h.engine.stop()
    first = next(e for e in h.events if isinstance(e, BlockStored))
    removed = [hh for e in h.events if isinstance(e, BlockRemoved) for hh in e.block_hashes]
    assert set(removed) <= set(first.block_hashes) and removed
    # The tail of the old prefix goes before its head (freed in reverse order).
    assert removed[0] == first.block_hashes[-1]
    held = {b.block_hash for b in h.cache.cached_blocks()}
    assert not held & set(removed) and h.cache.stats.evictions == len(removed)


async def test_blocks_in_use_are_never_evicted_requests_wait_instead():
    h = Harness(num_blocks=8, block_size=4)
    long = h.engine.submit(list(range(1, 13)), max_tokens=12)  # 12 prompt + 12 out: 6 blocks reserved
    other = h.engine.submit(list(range(50, 62)), max_tokens=1)  # needs 3 more: must wait
    h.engine.start()
    try:
        it = long.tokens()
        await it.__anext__()
        assert other in h.engine.waiting and not other.blocks.blocks
        assert all(b.ref_count == 1 for b in long.blocks.blocks) and not h.cache.stats.evictions
        rest = [t async for t in it]
        assert len(rest) == 11
        await asyncio.wait_for(other.outputs.get(), timeout=5)
    finally:
        await h.engine.stop()
    assert long.generated == 12 and other.cached_tokens == 0


async def test_simulated_ttft_falls_with_cache_hits():
    h = Harness(num_blocks=512, block_size=16)
    h.engine.start()
    try:
        prompt = list(range(1, 1001))
        cold, _ = await h.run(prompt, max_tokens=1)
        warm, _ = await h.run(prompt, max_tokens=1)
    finally:
        await h.engine.stop()
    t = TimingModel()
    assert cold.simulated_ttft_s == pytest.approx(t.step_seconds(1000, 0))
    assert warm.cached_tokens == 992
    assert warm.simulated_ttft_s == pytest.approx(t.step_seconds(8, 0))
    assert warm.simulated_ttft_s < cold.simulated_ttft_s / 10


async def test_ttft_grows_with_load():
    h = Harness(num_blocks=2048, block_size=16, max_batched_tokens=512)
    seqs = [h.engine.submit([i, *range(1000, 1400)], max_tokens=1) for i in range(4)]
    h.engine.start()
    try:
        await asyncio.gather(*(drain(s) for s in seqs))
    finally:
        await h.engine.stop()
    ttfts = [s.simulated_ttft_s for s in seqs]
    assert ttfts == sorted(ttfts) and ttfts[-1] > 3 * ttfts[0]


async def test_reset_refused_while_blocks_are_in_use(harness):
    seq = harness.engine.submit(list(range(1, 10)), max_tokens=50)
    await seq.outputs.get()
    assert harness.engine.reset_prefix_cache() is False
    harness.engine.abort(seq)
    assert harness.engine.reset_prefix_cache() is True
    assert isinstance(harness.events[-1], AllBlocksCleared) and harness.cache.cached_blocks() == []


def test_prompts_that_cannot_fit_are_rejected():
    h = Harness(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(PromptRejected, match="maximum context length"):
        h.engine.submit(list(range(60)), max_tokens=10)
    with pytest.raises(PromptRejected, match="KV-cache blocks"):
        h.engine.submit(list(range(20)), max_tokens=1)


def test_vllm_block_hashes_are_vllms_own(monkeypatch):
    """Reference digests printed by vLLM 0.32 itself (``hash_block_tokens`` with sha256)."""
    from simulator.block_hashes import VllmBlockHasher

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hasher = VllmBlockHasher("sha256")
    first = hasher(None, [1, 2, 3, 4])
    second = hasher(first, [5, 6, 7, 300000])
    assert first.hex() == "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a"
    assert second.hex() == "8a529cd3276a0f6699b855dac4799dbed1cddfeba811be6100bf6442eff6efcb"
    ints = VllmBlockHasher("sha256", int_hashes=True)
    assert ints(ints(None, [1, 2, 3, 4]), [5, 6, 7, 300000]) == 53871959208292299  # vLLM's int form
    # sha256 hashes are the same in every process and after a restart; xxhash's are seeded per process.
    hasher.reseed()
    assert hasher(None, [1, 2, 3, 4]) == first
    assert VllmBlockHasher("xxhash")(None, [1, 2]) != VllmBlockHasher("xxhash")(None, [1, 2])


async def test_a_batch_runs_at_most_max_loras_adapters_and_skips_to_those_it_can():
    h = Harness(max_loras=1)
    sql, poem = LoraKey("sql", "/a/sql", 1), LoraKey("poem", "/a/poem", 2)
    first = h.engine.submit(list(range(1, 9)), 4, lora=sql)
    blocked = h.engine.submit(list(range(11, 19)), 4, lora=poem)
    base = h.engine.submit(list(range(21, 29)), 4)  # the base model takes no slot: it passes the waiting one
    h.engine._schedule()
    assert h.engine.running == [first, base] and list(h.engine.waiting) == [blocked]
    assert (h.engine.lora.activations, h.engine.lora.loads) == (1, 1)
    h.engine.start()
    await asyncio.gather(drain(first), drain(blocked), drain(base))
    await h.engine.stop()
    assert h.engine.lora.activations == 2 and list(h.engine.lora.active) == ["poem"]


async def test_an_adapters_blocks_are_its_own_and_say_whose_they_are():
    h = Harness()
    h.engine.start()
    prompt = list(range(1, 10))
    for lora in (LoraKey("sql", "/a/sql", 1), None, LoraKey("sql", "/a/sql", 1)):
        seq = h.engine.submit(prompt, 1, lora=lora)
        await drain(seq)
    await h.engine.stop()
    stored = [e for e in h.events if isinstance(e, BlockStored)]
    assert [s.lora_name for s in stored] == ["sql", None]  # the third found the adapter's blocks cached
    assert stored[0].extra_keys == [["sql"], ["sql"]] and stored[0].block_hashes != stored[1].block_hashes


def test_slots_and_memory_are_least_recently_used_first():
    slots = LoraSlots(max_loras=2, max_cpu_loras=3)
    assert slots.activate({"a", "b"}) == (2, 2)
    assert slots.activate({"a"}) == (0, 0)
    assert slots.activate({"a", "c"}) == (1, 1) and set(slots.active) == {"a", "c"}  # b left its slot
    assert slots.activate({"b", "c"}) == (1, 0)  # b was still in memory
    assert slots.activate({"d", "b"}) == (1, 1) and "a" not in slots.memory  # a: least recently used


def stepped(h: Harness, *seqs) -> list[int]:
    """One step of ``h``'s engine, at once: how many prompt tokens each of ``seqs`` had computed after it."""
    assert h.engine.step_now()
    return [s.num_computed for s in seqs]


def test_a_step_goes_first_to_the_running_prefill_then_to_waiting_prompts_chunked_first_come_first_served():
    # vLLM 0.32's scheduler: the running requests first, each taking what it needs as far as the budget goes,
    # then the waiting ones in order, the first that does not fit chunked into what is left.
    h = Harness(num_blocks=64, block_size=4, max_batched_tokens=16)
    long, short, last = (h.engine.submit(list(range(at, at + n)), 1) for at, n in ((1, 40), (100, 6), (200, 8)))
    assert stepped(h, long, short, last) == [16, 0, 0]  # the long prompt's first chunk takes the step
    assert stepped(h, long, short, last) == [32, 0, 0]  # running first: the short one still waits
    assert stepped(h, long, short, last) == [40, 6, 2]  # its last chunk leaves 8 tokens: 6 for short, 2 for last
    assert stepped(h, long, short, last) == [40, 6, 8] and not h.engine.step_now()


def test_a_priority_engine_takes_waiting_requests_lowest_priority_first_but_never_before_a_running_prefill():
    h = Harness(num_blocks=64, block_size=4, max_batched_tokens=16, scheduling_policy="priority")
    running = h.engine.submit(list(range(1, 41)), 1, priority=5)
    assert stepped(h, running) == [16]
    late = h.engine.submit(list(range(100, 106)), 1, priority=1)
    urgent = h.engine.submit(list(range(200, 206)), 1, priority=-3)  # came later, better priority
    assert stepped(h, running, late, urgent) == [32, 0, 0]  # the running prefill keeps the step
    assert stepped(h, running, late, urgent) == [40, 2, 6]  # then the urgent one first, the other chunked
    fcfs = Harness(num_blocks=64, block_size=4, max_batched_tokens=8)
    first = fcfs.engine.submit(list(range(1, 7)), 1, priority=1)  # first come first served ignores priorities
    second = fcfs.engine.submit(list(range(100, 106)), 1, priority=-3)
    assert stepped(fcfs, first, second) == [6, 2]


def test_each_running_decode_takes_a_token_of_the_step_in_the_order_admitted():
    h = Harness(num_blocks=64, block_size=4, max_batched_tokens=16)
    decoding = [h.engine.submit([i, i + 1], 8) for i in (1, 10, 20)]
    assert stepped(h, *decoding) == [2, 2, 2]
    long = h.engine.submit(list(range(100, 140)), 1)
    stepped(h, long)
    assert long.num_computed == 13 and all(s.generated == 2 for s in decoding)  # 3 decodes + 13 prefilled


# Claude Code's first request: its system prompt and tools, and the answer it leaves room for.
AGENT_FIRST_PROMPT, AGENT_MAX_TOKENS = 4_400, 32_000


def test_the_quick_starts_pods_take_an_agent_tools_first_request():
    """``gateway serve --mock-pods``' pods (MockPodsConfig's defaults) take Claude Code's first request and end
    its answer after their text; a pod of 2,048 blocks, as they had before, refuses it."""
    from simulator.config import MockPodsConfig

    quick = MockPodsConfig()

    def submit(num_blocks: int) -> int:
        engine = MockEngine(PagedKvCache(num_blocks, quick.block_size), [5, 6, 7], lambda events: None,
                            ends_answers=quick.ends_answers)
        return engine.submit(list(range(1, AGENT_FIRST_PROMPT + 1)), AGENT_MAX_TOKENS).answer_length

    assert submit(quick.num_blocks) == 3  # the pod's text, not 32,000 tokens
    with pytest.raises(PromptRejected, match="KV-cache blocks"):
        submit(2048)


def test_a_pool_as_large_as_the_context_costs_nothing_until_used():
    """Blocks are made when first used: a pool of the model's whole context allocates little at start, and
    hands out uncached blocks in id order before reusing a cached one, as a pool made whole would."""
    import tracemalloc

    tracemalloc.start()
    cache = PagedKvCache(8193, 16)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 20_000, size
    assert cache.num_free == cache.usable_blocks == 8192
    first = cache.allocate(3)
    assert [b.block_id for b in first] == [1, 2, 3] and cache.num_free == 8189
    assert cache.usage() == pytest.approx(3 / 8192)


async def test_queue_time_is_what_a_request_waited_for_a_batch_slot():
    """vLLM's request_queue_time_seconds: from arrival to first scheduled. With one sequence a step, the
    second request waits for the first to finish; the first never waits."""
    h = Harness(max_num_seqs=1)
    h.engine.timing = TimingModel(speed=1.0, step_base_s=0.01)
    h.engine.start()
    try:
        first = h.engine.submit(list(range(1, 9)), 3, "first")
        second = h.engine.submit(list(range(20, 28)), 3, "second")
        await drain(first)
        await drain(second)
    finally:
        await h.engine.stop()
    queued = h.engine.queue_by_request
    assert queued["first"] < 0.01 <= 2 * 0.01 <= queued["second"]  # behind the first's three steps
    assert sum(h.engine.queue_time_buckets) == 2
    assert h.engine.queue_time_sum_s == pytest.approx(queued["first"] + queued["second"])
