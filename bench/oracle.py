"""How far from the best a contender's hit ratio is: two reference hit ratios computed offline from a trace.

Owner: nothing with a lifetime: functions from a trace (its prompts as token ids) and the pods' block size
and KV capacity to hit ratios.

- ``infinite``: the share of prompt tokens that could be a cache hit if every block ever computed stayed
  cached on every pod: a block hits only if an earlier request computed the same block prefix.
- ``sticky_lru``: a sticky, balanced placement under each pod's own LRU. Each session goes to one pod when
  it starts, and all its requests with it: among the pods assigned at most one session more than the least
  loaded (sessions assigned so far), the one holding the longest cached prefix of its first prompt (ties:
  the least loaded, then the first). Each pod is the simulated pod's own cache
  (:class:`~simulator.kvcache.PagedKvCache`, vLLM's block pool: LRU over free blocks, a finished
  request's blocks freed tail first, ``num_blocks`` of them with one kept as the null block).
- ``keep_warm``: the same placement, each pod evicting the free cached block whose next use on it is the
  farthest (Belady's MIN; one never used again first). It is what refreshes could reach if they cost
  nothing and knew the future: a prompt-only request over a context moves its blocks to the LRU's far end,
  so enough of them order the free queue as this does. Between ``sticky_lru`` and it lies what keep-warm
  can win at this placement.

Hits are counted as the pods count them (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, and
:meth:`simulator.engine.MockEngine._admit`): each prompt token of an admitted request is a query, the
hits are the whole blocks of its longest cached prefix, at most ``(n - 1) // block_size`` blocks of an
``n``-token prompt (the engine always computes the last prompt token). A request needing more blocks than
the smallest pod has is left out of both (that pod would refuse it, and it would count nothing). Once a
request ends, its prompt's full blocks are cached, and so are its answer's, up to but not including the
answer's last token (whose KV is never computed).

Answers are part of later prompts, and no oracle knows what an engine will generate. This one is computed
after a run, from the answers the run's replay recorded: their text as the later prompts carried it, and
their tokens re-encoded from that text for the answer's own blocks (exact for the simulated pods, whose
answers re-encode to the tokens they generated; a real engine's may differ by a token or end on an EOS
that the text lacks). A request that failed recorded an empty answer, as its session's next prompt did.

Requests are taken in the replay's order without service time: each session's start plus its think
times (:meth:`~bench.workloads.Session.send_times`), ties by session then step; each runs alone
and ends before the next begins. A measured run overlaps requests, so a request may miss blocks another
is still computing: ``sticky_lru`` is a reference a router can beat, ``infinite`` a bound it cannot (but
for such reordering).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from bench.workloads import History, Trace
from gateway.kv.hashing import namespace_root, prefix_hashes
from gateway.tokenization.hf import HfTokenizer
from gateway.tokenization.segments import SegmentEncoder
from simulator.kvcache import Block, PagedKvCache, SequenceBlocks

# Recorded answers by (session index, step index).
Answers = Mapping[tuple[int, int], str]


@dataclass(frozen=True, slots=True)
class OracleRequest:
    session: int  # its session's index; a session's requests come in order
    prompt_len: int
    max_tokens: int
    # The prompt, then the answer's tokens whose KV the engine computed (all but the last).
    tokens: list[int]
    # Where its blocks' hashes begin: a LoRA adapter's requests cache their own blocks (0: the base model's).
    root: int = 0

    def blocks_needed(self, block_size: int) -> int:
        """KV blocks the engine must have to admit it: the prompt and the whole answer."""
        return -(-(self.prompt_len + self.max_tokens) // block_size)

    def blocks_held(self, block_size: int) -> int:
        """KV blocks it holds when it ends: its prompt's and its computed answer's."""
        return -(-max(self.prompt_len, len(self.tokens)) // block_size)


class Oracle(msgspec.Struct, frozen=True):
    infinite: float
    sticky_lru: float
    keep_warm: float


class ChatEncoder:
    """Chat messages to the token ids the engine computes: the chat template rendered as vLLM renders it, then
    the tokenizer, segment by segment where that is exact (:class:`SegmentEncoder` checks it), so a
    conversation that grows by one message costs one new segment."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self.tokenizer = tokenizer
        self._segments = SegmentEncoder(tokenizer)
        self._segments.self_check()

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._segments.encode(self.tokenizer.render_chat(messages)).tolist()

    def text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def oracle_requests(trace: Trace, encoder: ChatEncoder, answers: Answers) -> list[OracleRequest]:
    """The trace's requests as token ids, in the replay's order without service time."""
    timed: list[tuple[float, int, int, OracleRequest]] = []
    for s, session in enumerate(trace.sessions):
        history = History(session)
        for i, (sent, step) in enumerate(zip(session.send_times(), session.steps, strict=True)):
            prompt = encoder.chat(history.prompt(step))
            answer = answers.get((s, i), "")
            history.answered(answer)
            generated = encoder.text(answer)[: step.max_tokens]
            root = namespace_root("", step.model) if step.model else 0
            timed.append((sent, s, i, OracleRequest(s, len(prompt), step.max_tokens, prompt + generated[:-1],
                                                    root)))
    timed.sort(key=lambda t: t[:3])
    return [request for *_, request in timed]


def _admitted(requests: list[OracleRequest], block_size: int,
              capacity_blocks: int) -> Iterator[tuple[OracleRequest, list[int], int]]:
    """The requests that fit a pod of ``capacity_blocks`` (as the engine reports them: vLLM keeps one as its
    null block), each with the chained hashes of its full blocks and how many of them may hit."""
    for request in requests:
        if request.blocks_needed(block_size) <= capacity_blocks - 1:
            may_hit = (request.prompt_len - 1) // block_size
            yield request, prefix_hashes(request.root, request.tokens, block_size), may_hit


def infinite_hit_ratio(requests: list[OracleRequest], block_size: int, capacity_blocks: int) -> float:
    """Hit ratio if every block ever computed stayed cached on every pod; requests needing more than
    ``capacity_blocks`` (the smallest pod's) are left out."""
    computed: set[int] = set()
    queries = hits = 0
    for request, hashes, may_hit in _admitted(requests, block_size, capacity_blocks):
        queries += request.prompt_len
        found = 0
        while found < may_hit and hashes[found] in computed:
            found += 1
        hits += found * block_size
        computed.update(hashes)
    return hits / queries if queries else 0.0


def sticky_lru_hit_ratio(requests: list[OracleRequest], block_size: int, capacities: list[int]) -> float:
    """Hit ratio of the sticky, balanced placement over pods of ``capacities`` blocks, each its own LRU."""
    return _sticky(requests, block_size, capacities)[0]


def _sticky(requests: list[OracleRequest], block_size: int,
            capacities: list[int]) -> tuple[float, list[tuple[int, OracleRequest, list[int], int]]]:
    """The sticky placement's hit ratio under LRU, and its admitted requests in order, each with its pod, the
    chained hashes of its full blocks and how many of them may hit."""
    caches = [PagedKvCache(blocks, block_size) for blocks in capacities]
    sessions_on = [0] * len(caches)
    pod_of: dict[int, int] = {}
    placed = []
    queries = hits = 0
    for request, hashes, may_hit in _admitted(requests, block_size, min(capacities)):
        if request.session not in pod_of:
            pod = _place(caches, sessions_on, hashes[:may_hit])
            pod_of[request.session] = pod
            sessions_on[pod] += 1
        queries += request.prompt_len
        hits += _serve(caches[pod_of[request.session]], request, hashes, may_hit) * block_size
        placed.append((pod_of[request.session], request, hashes, may_hit))
    return (hits / queries if queries else 0.0), placed


def keep_warm_hit_ratio(requests: list[OracleRequest], block_size: int, capacities: list[int]) -> float:
    """Hit ratio of the sticky placement with each pod evicting farthest next use first (free, clairvoyant
    refreshes)."""
    _, placed = _sticky(requests, block_size, capacities)
    uses: list[dict[int, list[int]]] = [{} for _ in capacities]  # per pod: block hash -> positions hitting it
    for position, (pod, _, hashes, may_hit) in enumerate(placed):
        for h in hashes[:may_hit]:
            uses[pod].setdefault(h, []).append(position)
    caches = [ClairvoyantKvCache(blocks, block_size, pod_uses) for blocks, pod_uses in zip(capacities, uses,
                                                                                          strict=True)]
    queries = hits = 0
    for position, (pod, request, hashes, may_hit) in enumerate(placed):
        caches[pod].now = position
        queries += request.prompt_len
        hits += _serve(caches[pod], request, hashes, may_hit) * block_size
    return hits / queries if queries else 0.0


class ClairvoyantKvCache(PagedKvCache):
    """A pod's block pool that reuses a free block caching nothing first, as vLLM does, and then the cached
    one whose next use (by the request at that position of the trace) is the farthest (Belady's MIN)."""

    def __init__(self, num_blocks: int, block_size: int, uses: dict[int, list[int]]) -> None:
        super().__init__(num_blocks, block_size)
        self.now = 0  # the position of the request being served
        self._uses = uses
        # Free cached blocks by next use, farthest first: (-next use, -depth, block id, when freed); stale
        # entries (the block was hit, or freed again since) are skipped.
        self._by_next_use: list[tuple[float, int, int, int]] = []
        self._freed_at: dict[int, int] = {}
        self._frees = itertools.count()

    def free(self, seq: SequenceBlocks) -> None:
        blocks = seq.blocks
        super().free(seq)
        for depth, block in enumerate(blocks):
            if block.ref_count == 0 and block.block_hash is not None:
                self._freed_at[block.block_id] = freed = next(self._frees)
                # Ties go deepest first: a block is no use once its parent is gone.
                heapq.heappush(self._by_next_use, (-self._next_use(block), -depth, block.block_id, freed))

    def _next_use(self, block: Block) -> float:
        """When the block will be hit next: never for a second copy of a hash (lookups find the first)."""
        if not isinstance(block.block_hash, int) or self.copy_rank(block) > 0:
            return math.inf
        positions = self._uses.get(block.block_hash, [])
        i = bisect.bisect_right(positions, self.now)
        return positions[i] if i < len(positions) else math.inf

    def _next_free(self) -> Block:
        uncached = self._take_uncached()
        if uncached is not None:
            return uncached
        while True:
            *_, block_id, freed = heapq.heappop(self._by_next_use)
            if block_id in self._free and self._freed_at.get(block_id) == freed:
                return self._free.pop(block_id)


def _place(caches: list[PagedKvCache], sessions_on: list[int], lookup: list[int]) -> int:
    balanced = [p for p, n in enumerate(sessions_on) if n <= min(sessions_on) + 1]
    return max(balanced, key=lambda p: (len(caches[p].cached_prefix(lookup)), -sessions_on[p], -p))


def _serve(cache: PagedKvCache, request: OracleRequest, hashes: list[int], may_hit: int) -> int:
    """One request alone on the pod, from admission to its end, as the engine runs it; its hit blocks."""
    hit = cache.cached_prefix(hashes[:may_hit])
    cache.touch(hit)
    fresh = cache.allocate(request.blocks_held(cache.block_size) - len(hit))
    seq = SequenceBlocks(blocks=hit + fresh, hashes=hashes, num_cached=len(hit))
    cache.cache_full_blocks(seq, request.tokens)
    cache.free(seq)
    cache.take_events()  # nobody listens
    return len(hit)


def compute_oracle(requests: list[OracleRequest], block_size: int, capacities: list[int]) -> Oracle:
    return Oracle(infinite=infinite_hit_ratio(requests, block_size, min(capacities)),
                  sticky_lru=sticky_lru_hit_ratio(requests, block_size, capacities),
                  keep_warm=keep_warm_hit_ratio(requests, block_size, capacities))


def trace_oracle(trace: Trace, encoder: ChatEncoder, answers: Answers, block_size: int,
                 capacities: list[int]) -> Oracle:
    """Both references for ``trace`` as a run with these ``answers`` sent it, on pods of this block size and
    these capacities (blocks)."""
    return compute_oracle(oracle_requests(trace, encoder, answers), block_size, capacities)
