"""The simulated engine: continuous batching over a paged KV cache, with a timing model.

Owner: the :class:`MockEngine` owns its waiting queue, running batch and the pod's
:class:`~simulator.kvcache.PagedKvCache`; the HTTP layer only submits and aborts sequences.

Each scheduler step, as vLLM 0.32's: a budget of ``max_batched_tokens`` goes first to the running sequences,
in the order they were admitted, each taking what it needs (one token to decode, the rest of its prompt to
prefill) as far as the budget goes, so a long prefill admitted earlier takes the step before a later
sequence's prefill or decode; what is left admits waiting sequences, in the waiting queue's order (first
come, first served; or with ``scheduling_policy`` priority, the lowest ``priority`` first, then the earliest
arrival), each prefilling as much of its prompt as the budget leaves (chunked), while slots and blocks allow;
the queue's head waiting for blocks holds the others back. A waiting sequence never preempts a running one
for the budget (vLLM preempts only for blocks, which the simulator reserves at admission instead).
``tests/e2e/test_flow_control.py`` checks the steps against a real pod's, event batch for event batch.
A step takes ``base + prefill_tokens * per_token + decode_seqs * per_seq`` seconds, times the speed factor.
Cached prompt tokens are not prefilled, so TTFT falls with cache hits and rises with load, as on a real
engine. The KV events of a step leave as one batch.

LoRA adapters, as vLLM runs them (:class:`LoraSlots`): a step's batch holds requests of at most
``max_loras`` adapters (a waiting request of another adapter is skipped until one drains), each active in a
batch slot; switching an adapter into a slot costs ``lora_activate_s``, and reading one that is not in host
memory (``max_cpu_loras``, least recently used first) from its path costs ``lora_load_s``. An adapter's
requests cache their own blocks (their hashes carry it).

With a KV connector (:mod:`simulator.kv_transfer`), prompt tokens may also come from outside, as vLLM's
connectors bring them: a sequence admitted with tokens the connector holds loads them (a small cost per
token, not their prefill) and recomputes at least the last prompt token; a producer's finished sequence
may keep its blocks until a consumer has pulled them.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

from gateway.background import cancel_and_wait
from gateway.kv.events import KvEvent
from gateway.lru import LruCache
from simulator.kvcache import LoraKey, PagedKvCache, SequenceBlocks


class TimingModel(msgspec.Struct, frozen=True):
    step_base_s: float = 0.004
    prefill_per_token_s: float = 0.00008
    decode_per_seq_s: float = 0.0002
    # Loading a token's KV from a connector (another pod's memory, shared storage): far less than its prefill.
    kv_load_per_token_s: float = 0.000005
    # A LoRA adapter switched into a batch slot (its weights copied in), and read from its path into memory.
    lora_activate_s: float = 0.01
    lora_load_s: float = 0.2
    # Multiplies every simulated duration: 1 is a mid-size GPU, 0.1 ten times faster, 0 no delay at all.
    speed: float = 1.0

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, loaded_tokens: int = 0, activations: int = 0,
                     lora_loads: int = 0) -> float:
        """Simulated duration of one step at speed 1 (the engine sleeps this times ``speed``)."""
        return (self.step_base_s + prefill_tokens * self.prefill_per_token_s + decode_seqs * self.decode_per_seq_s
                + loaded_tokens * self.kv_load_per_token_s + activations * self.lora_activate_s
                + lora_loads * self.lora_load_s)


# The context length of the simulated model (a Llama-3.1-shaped one).
MODEL_MAX_LEN = 131_072
RECENT_TTFTS = 100_000
# The upper bounds of ``vllm:request_queue_time_seconds``' buckets: vLLM's own start at 0.3 s, finer here,
# as the simulated pods run at a fraction of a GPU's time and queue for milliseconds.
QUEUE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


SchedulingPolicy = Literal["fcfs", "priority"]


class EngineLimits(msgspec.Struct, frozen=True):
    max_num_seqs: int = 128
    max_batched_tokens: int = 2048
    max_model_len: int = MODEL_MAX_LEN
    # vLLM's --max-loras (adapters in one batch) and --max-cpu-loras (kept in memory; none: max_loras).
    max_loras: int = 1
    max_cpu_loras: int | None = None
    # How the waiting queue is ordered (vLLM's --scheduling-policy).
    scheduling_policy: SchedulingPolicy = "fcfs"


class LoraSlots:
    """One engine's LoRA memory: ``max_loras`` batch slots (a batch runs only adapters active in one) and
    ``max_cpu_loras`` adapters in host memory, each least recently used first to go. Counts the adapters
    switched into a slot (``activations``) and read from their path (``loads``)."""

    def __init__(self, max_loras: int, max_cpu_loras: int | None) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.active: dict[str, None] = {}  # least recently used first
        self.memory: dict[str, None] = {}
        self.activations = 0
        self.loads = 0

    def load(self, name: str) -> bool:
        """``name`` in memory (registering an adapter preloads it); whether it had to be read."""
        if name in self.memory:
            self.memory[name] = self.memory.pop(name)
            return False
        while len(self.memory) >= self.max_cpu_loras:
            victim = next((n for n in self.memory if n not in self.active), next(iter(self.memory)))
            del self.memory[victim]
            self.active.pop(victim, None)
        self.memory[name] = None
        self.loads += 1
        return True

    def remove(self, name: str) -> None:
        self.memory.pop(name, None)
        self.active.pop(name, None)

    def activate(self, batch: set[str]) -> tuple[int, int]:
        """Every adapter of a step's ``batch`` in a slot: (switched in, read from their path) this step."""
        switched = loaded = 0
        for name in batch:
            if name in self.active:
                self.active[name] = self.active.pop(name)
                continue
            loaded += self.load(name)
            if len(self.active) >= self.max_loras:
                victim = next(n for n in self.active if n not in batch)
                del self.active[victim]
            self.active[name] = None
            switched += 1
        self.activations += switched
        return switched, loaded


class PromptRejected(ValueError):
    """The prompt can never run on this engine (too long for the model or the cache)."""


class EngineConnector(Protocol):
    """What the engine asks a KV connector (:mod:`simulator.kv_transfer`)."""

    def loadable(self, seq: Sequence) -> int:
        """Prompt tokens of ``seq``, from the first, that the connector can load."""
        ...

    def prefilled(self, seq: Sequence) -> None:
        """``seq``'s prompt is computed (a producer may save it)."""
        ...


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]
    prompt_len: int
    max_tokens: int
    arrived: float
    # How many tokens it will generate: ``max_tokens``, or fewer when the model ends its answer first.
    answer_length: int = 0
    # vLLM's request priority (lower first, with the priority policy) and the order it arrived in.
    priority: int = 0
    index: int = 0
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)
    num_computed: int = 0
    cached_tokens: int = 0
    # From a KV connector: tokens the sequence may load (beyond what the connector itself finds), those it
    # loaded, the cached tokens to report instead of its own (vLLM's D node reports its P node's), and
    # whether it keeps its blocks when it finishes, until a consumer pulls them.
    pulled_tokens: int = 0
    loaded_tokens: int = 0
    reported_cached_tokens: int | None = None
    hold_blocks: bool = False
    reserved_blocks: int = 0
    generated: int = 0
    first_token_at: float | None = None
    # When the scheduler first took it from the waiting queue (vLLM's queue time ends there).
    scheduled_at: float | None = None
    # On the engine's simulated clock (speed 1), independent of how fast the host runs the simulation.
    submitted_clock: float = 0.0
    simulated_ttft_s: float | None = None
    finished: bool = False
    outputs: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)

    @property
    def lora(self) -> LoraKey | None:
        return self.blocks.lora

    @property
    def ended(self) -> bool:
        """Whether the model ended its answer (an end-of-sequence token) before ``max_tokens``."""
        return self.answer_length < self.max_tokens

    async def tokens(self) -> AsyncIterator[int]:
        while (token := await self.outputs.get()) is not None:
            yield token


class WaitingQueue:
    """The engine's waiting sequences in the order the scheduler takes them: as they came (fcfs), or by
    ``priority`` (lowest first), then as they came (vLLM's ``PriorityRequestQueue``)."""

    def __init__(self, policy: SchedulingPolicy = "fcfs") -> None:
        self._by_priority = policy == "priority"
        self._items: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if self._by_priority:
            bisect.insort(self._items, seq, key=lambda s: (s.priority, s.index))
        else:
            self._items.append(seq)

    def peek(self) -> Sequence:
        return self._items[0]

    def pop(self) -> Sequence:
        return self._items.pop(0)

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def put_back(self, seqs: list[Sequence]) -> None:
        """Sequences taken out in turn and skipped go back where they stood (vLLM skips, it does not reorder)."""
        if self._by_priority:
            for seq in seqs:
                self.add(seq)
        else:
            self._items[:0] = seqs

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def __contains__(self, seq: object) -> bool:
        return seq in self._items  # sequences compare by identity


@dataclass(slots=True)
class _Step:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    loaded_tokens: int = 0
    lora_activations: int = 0
    lora_loads: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk for _, chunk in self.prefill)


class MockEngine:
    def __init__(
        self,
        cache: PagedKvCache,
        output_tokens: list[int],
        publish: Callable[[list[KvEvent]], None],
        timing: TimingModel | None = None,
        limits: EngineLimits | None = None,
        connector: EngineConnector | None = None,
        ends_answers: bool = False,
    ) -> None:
        if not output_tokens:
            raise ValueError("output_tokens must not be empty")
        self.cache = cache
        self.timing = timing or TimingModel()
        self.limits = limits or EngineLimits()
        self._output_tokens = output_tokens
        # A real model ends its answer (end of sequence) when it is done; a benchmark's pod writes until
        # ``max_tokens``, so that outputs are as long as its trace says.
        self._answer_cap = len(output_tokens) if ends_answers else None
        self._publish = publish
        self.connector = connector
        self.waiting = WaitingQueue(self.limits.scheduling_policy)
        self.running: list[Sequence] = []
        self.lora = LoraSlots(self.limits.max_loras, self.limits.max_cpu_loras)
        self._reserved = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.clock = 0.0  # simulated seconds of engine work so far
        self.finished_requests = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # vLLM's external_prefix_cache_*: prompt tokens looked up through the connector, and those loaded.
        self.external_queries = 0
        self.external_hits = 0
        # Time to first token of finished prefills (vLLM's time_to_first_token_seconds histogram).
        self.ttft_sum_s = 0.0
        self.ttft_count = 0
        # The same per request id, the latest RECENT_TTFTS: what a benchmark subtracts from its client's TTFT
        # to see what the router in between added (``GET /debug/ttft``).
        self.ttft_by_request: LruCache[str, float] = LruCache(RECENT_TTFTS)
        # Time in the waiting queue, from arrival to first scheduled (vLLM's request_queue_time_seconds):
        # per bucket of QUEUE_TIME_BUCKETS (the last one: past them all), their sum, and per request id.
        self.queue_time_buckets = [0] * (len(QUEUE_TIME_BUCKETS) + 1)
        self.queue_time_sum_s = 0.0
        self.queue_by_request: LruCache[str, float] = LruCache(RECENT_TTFTS)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="mock-engine")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def submit(self, prompt: list[int], max_tokens: int, request_id: str | None = None, *, priority: int = 0,
               pulled_tokens: int = 0, reported_cached_tokens: int | None = None, hold_blocks: bool = False,
               lora: LoraKey | None = None, token_hash_root: int | None = None) -> Sequence:
        if not prompt:
            raise PromptRejected("The prompt is empty.")
        if max_tokens < 1:  # as vLLM's sampling parameters refuse it
            raise PromptRejected(f"max_tokens must be at least 1, got {max_tokens}.")
        if len(prompt) + max_tokens > self.limits.max_model_len:
            raise PromptRejected(
                f"This model's maximum context length is {self.limits.max_model_len} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                f"{max_tokens} in the completion)."
            )
        bs = self.cache.block_size
        if -(-(len(prompt) + max_tokens) // bs) > self.cache.usable_blocks:
            raise PromptRejected("The request needs more KV-cache blocks than this engine has.")
        length = max_tokens if self._answer_cap is None else min(max_tokens, self._answer_cap)
        index = next(self._ids)
        seq = Sequence(request_id or f"req-{index}", list(prompt), len(prompt), max_tokens, time.monotonic(),
                       length, priority, index, submitted_clock=self.clock, pulled_tokens=pulled_tokens,
                       reported_cached_tokens=reported_cached_tokens, hold_blocks=hold_blocks,
                       blocks=SequenceBlocks(lora=lora, token_hash_root=token_hash_root))
        self.waiting.add(seq)
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finished = True
            seq.outputs.put_nowait(None)
        elif seq in self.running:
            self._finish(seq)

    def release(self, seq: Sequence) -> None:
        """A finished sequence that kept its blocks (for a consumer to pull) lets them go."""
        if seq.finished and seq.blocks.blocks:
            self.cache.free(seq.blocks)

    def reset_prefix_cache(self) -> bool:
        ok = self.cache.reset()
        self._flush_events()
        return ok

    # The scheduler loop

    async def _run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            step = self._schedule()
            seconds = self.timing.step_seconds(step.prefill_tokens, len(step.decode), step.loaded_tokens,
                                               step.lora_activations, step.lora_loads)
            self.clock += seconds
            # Even with no simulated delay, yield so HTTP handlers run between steps.
            await asyncio.sleep(seconds * self.timing.speed)
            self._complete(step)
            self._flush_events()

    def step_now(self) -> bool:
        """One scheduler step at once, its simulated time counted but not slept (for replaying a real engine's
        steps without the loop: not with :meth:`start`); False when there was nothing to do."""
        step = self._schedule()
        if not step.prefill and not step.decode:
            return False
        self.clock += self.timing.step_seconds(step.prefill_tokens, len(step.decode), step.loaded_tokens)
        self._complete(step)
        self._flush_events()
        return True

    def _schedule(self) -> _Step:
        step = _Step()
        budget = self.limits.max_batched_tokens
        for seq in self.running:  # in the order they were admitted
            if budget <= 0:
                break
            if seq.num_computed >= seq.prompt_len:
                step.decode.append(seq)
                budget -= 1
            else:
                budget -= self._prefill_chunk(step, seq, budget)
        adapters = {s.lora.name for s in self.running if s.lora is not None}
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting.peek()
            if seq.lora is not None and seq.lora.name not in adapters and len(adapters) >= self.limits.max_loras:
                skipped.append(self.waiting.pop())  # as vLLM: no batch slot for its adapter, the next may go
                continue
            if not self._admit(seq):
                break  # the head waits for blocks, the rest wait behind it
            self.waiting.pop()
            self.running.append(seq)
            self._scheduled(seq)
            if seq.lora is not None:
                adapters.add(seq.lora.name)
            step.loaded_tokens += seq.loaded_tokens
            budget -= self._prefill_chunk(step, seq, budget)
        self.waiting.put_back(skipped)
        if adapters:
            step.lora_activations, step.lora_loads = self.lora.activate(adapters)
        return step

    def _scheduled(self, seq: Sequence) -> None:
        """``seq`` leaves the waiting queue for the batch: its queue time is observed."""
        seq.scheduled_at = time.monotonic()
        waited = seq.scheduled_at - seq.arrived
        self.queue_time_buckets[bisect.bisect_left(QUEUE_TIME_BUCKETS, waited)] += 1
        self.queue_time_sum_s += waited
        self.queue_by_request.put(seq.request_id, waited)

    def _prefill_chunk(self, step: _Step, seq: Sequence, budget: int) -> int:
        """Schedule the next chunk of ``seq``'s prompt. As vLLM does, the blocks the chunk fills are cached
        as it is scheduled, so a request admitted after it in the same step already finds them."""
        chunk = min(budget, seq.prompt_len - seq.num_computed)
        step.prefill.append((seq, chunk))
        self.cache.cache_full_blocks(seq.blocks, seq.token_ids, seq.num_computed + chunk)
        return chunk

    def _admit(self, seq: Sequence) -> bool:
        cache, bs = self.cache, self.cache.block_size
        if not seq.blocks.hashes:
            seq.blocks.hashes = cache.chain_hashes(seq.token_ids, lora=seq.lora)
        # The engine always computes the last prompt token, so it can never be a hit.
        hit = cache.cached_prefix(seq.blocks.hashes[: (seq.prompt_len - 1) // bs])
        prompt_blocks = -(-seq.prompt_len // bs)
        reserve = -(-(seq.prompt_len + seq.max_tokens) // bs) - prompt_blocks
        if cache.free_blocks_excluding(hit) - self._reserved < prompt_blocks - len(hit) + reserve:
            return False
        cache.touch(hit)
        seq.blocks.blocks = hit + cache.allocate(prompt_blocks - len(hit))
        seq.blocks.num_cached = len(hit)
        local = len(hit) * bs
        seq.loaded_tokens = max(0, self._loadable(seq) - local)
        self.external_hits += seq.loaded_tokens
        seq.cached_tokens = local + seq.loaded_tokens
        # A whole prompt loaded still recomputes its last token, to sample the next one.
        seq.num_computed = min(seq.cached_tokens, seq.prompt_len - 1)
        if seq.reported_cached_tokens is not None:
            seq.cached_tokens = seq.reported_cached_tokens
        seq.reserved_blocks = reserve
        self._reserved += reserve
        cache.stats.queries += seq.prompt_len
        cache.stats.hits += local
        self.prompt_tokens_total += seq.prompt_len
        return True

    def _loadable(self, seq: Sequence) -> int:
        if self.connector is None:
            return 0
        self.external_queries += seq.prompt_len
        return max(seq.pulled_tokens, self.connector.loadable(seq))

    def _complete(self, step: _Step) -> None:
        for seq, chunk in step.prefill:
            if seq.finished:
                continue
            seq.num_computed += chunk
            if seq.num_computed >= seq.prompt_len:
                if self.connector is not None:
                    self.connector.prefilled(seq)
                self._emit(seq)
        for seq in step.decode:
            if not seq.finished:
                self.cache.cache_full_blocks(seq.blocks, seq.token_ids)
                self._emit(seq)

    def _emit(self, seq: Sequence) -> None:
        token = self._output_tokens[seq.generated % len(self._output_tokens)]
        seq.token_ids.append(token)
        seq.generated += 1
        self.generation_tokens_total += 1
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            seq.simulated_ttft_s = self.clock - seq.submitted_clock
            ttft = seq.first_token_at - seq.arrived
            self.ttft_sum_s += ttft
            self.ttft_count += 1
            self.ttft_by_request.put(seq.request_id, ttft)
        seq.outputs.put_nowait(token)
        if seq.generated >= seq.answer_length:
            self.finished_requests += 1
            self._finish(seq)
        elif len(seq.token_ids) > len(seq.blocks.blocks) * self.cache.block_size:
            seq.blocks.blocks += self.cache.allocate(1)
            seq.reserved_blocks -= 1
            self._reserved -= 1

    def _finish(self, seq: Sequence) -> None:
        seq.finished = True
        self.running.remove(seq)
        if not (seq.hold_blocks and seq.generated):  # an aborted producer's blocks are nobody's to pull
            self.cache.free(seq.blocks)
        self._reserved -= seq.reserved_blocks
        seq.reserved_blocks = 0
        seq.outputs.put_nowait(None)

    def _flush_events(self) -> None:
        events = self.cache.take_events()
        if events:
            self._publish(events)
