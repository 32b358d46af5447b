"""The bench's oracle: the infinite-cache bound and the sticky LRU placement, on hand-built token traces whose
answers are known, and against a brute-force model of vLLM's block pool written independently of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.oracle import (
    OracleRequest,
    compute_oracle,
    infinite_hit_ratio,
    keep_warm_hit_ratio,
    sticky_lru_hit_ratio,
)


def req(session: int, prompt: list[int], max_tokens: int = 1, answer: list[int] | None = None) -> OracleRequest:
    """A request whose answer's computed tokens (all but the last) join its cached blocks."""
    return OracleRequest(session, len(prompt), max_tokens, prompt + (answer or [])[: max_tokens][:-1])


def seq(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_a_growing_conversation_that_fits_hits_its_earlier_blocks():
    # Blocks of 4. The second prompt (18 tokens) may hit (18 - 1) // 4 = 4 blocks; the first left 10 // 4 = 2.
    # The third (25 tokens) may hit 6; the second left 18 // 4 = 4.
    requests = [req(0, seq(0, 10)), req(0, seq(0, 18)), req(0, seq(0, 25))]
    expected = (0 + 2 * 4 + 4 * 4) / (10 + 18 + 25)
    assert infinite_hit_ratio(requests, 4, 100) == expected
    assert sticky_lru_hit_ratio(requests, 4, [100]) == expected
    # The last prompt token is always computed: a repeat of a 16-token prompt hits 3 blocks, not 4.
    assert infinite_hit_ratio([req(0, seq(0, 16)), req(0, seq(0, 16))], 4, 100) == 12 / 32


def test_answer_blocks_are_cached_but_not_the_last_answer_token():
    # 6 prompt tokens and an answer of 3 (5 computed: 6 + 2 = 8 tokens, two full blocks); the next prompt
    # carries the answer's first two tokens, then goes on.
    first = req(0, seq(0, 6), max_tokens=3, answer=[50, 51, 52])
    assert first.tokens == [*seq(0, 6), 50, 51]
    follow = req(0, [*seq(0, 6), 50, 51, 52, 53, 54])
    assert infinite_hit_ratio([first, follow], 4, 100) == 8 / (6 + 11)


def test_two_sessions_that_thrash_one_pod_keep_only_their_heads():
    # Each 16-token prompt needs 5 blocks of 4 (with its answer); a pod of 6 has 5 (one is vLLM's null block).
    # A's blocks are freed tail first, so B's take A's tail and A's first block survives at the LRU's far end,
    # and the other way round.
    a, b = seq(0, 16), seq(100, 16)
    requests = [req(0, a), req(1, b), req(0, a), req(1, b)]
    assert sticky_lru_hit_ratio(requests, 4, [6]) == (4 + 4) / 64
    # Infinite: both repeats hit (16 - 1) // 4 = 3 blocks. Two such pods: each session on its own.
    assert infinite_hit_ratio(requests, 4, 6) == (12 + 12) / 64
    assert sticky_lru_hit_ratio(requests, 4, [6, 6]) == (12 + 12) / 64
    # A request needing more blocks than the smallest pod has is refused there: it counts in neither; nor
    # does one that would need the null block.
    assert sticky_lru_hit_ratio([*requests, req(2, seq(200, 40))], 4, [6, 50]) == (12 + 12) / 64
    assert infinite_hit_ratio([*requests, req(2, seq(200, 40))], 4, 6) == (12 + 12) / 64
    assert sticky_lru_hit_ratio(requests, 4, [5]) == 0.0


def test_blocks_caching_nothing_are_reused_before_cached_ones():
    # A pod of 4 blocks (3 usable), blocks of 4. A and B (5 tokens) each leave one cached block and one partial
    # one; C (3 tokens) needs one block: it takes B's partial block, freed to the front of the queue, not A's
    # cached block, the least recently freed. So A, back with more, finds its first block.
    a, b, c = seq(0, 5), seq(100, 5), seq(200, 3)
    requests = [req(0, a), req(1, b), req(2, c), req(0, seq(0, 9))]
    assert sticky_lru_hit_ratio(requests, 4, [4]) == 4 / (5 + 5 + 3 + 9)


def test_free_refreshes_keep_what_comes_back_and_let_go_what_does_not():
    # A pod of 4 usable blocks; A, B and C hold 2 each. Under LRU, C evicts A (freed longest ago), which comes
    # back; refreshed at no cost, the pod would evict B, which never comes back, and A hits its 2 blocks.
    a, b, c = seq(0, 8), seq(100, 8), seq(200, 8)
    requests = [req(0, a), req(1, b), req(2, c), req(0, seq(0, 9))]
    assert sticky_lru_hit_ratio(requests, 4, [5]) == 0.0
    assert keep_warm_hit_ratio(requests, 4, [5]) == 8 / 33
    assert compute_oracle(requests, 4, [5]).keep_warm == 8 / 33


def test_sessions_sharing_a_prefix_follow_it_within_one_session_of_balance():
    shared = seq(0, 8)
    a, b, c = (req(s, shared + seq(100 * (s + 1), 8)) for s in range(3))
    # Two sessions on one pod or two: B joins A where the shared prefix is (2 blocks of its 3 that may hit).
    assert sticky_lru_hit_ratio([a, b], 4, [100]) == 8 / 32
    assert sticky_lru_hit_ratio([a, b], 4, [100, 100]) == 8 / 32
    # A third would make that pod two sessions busier than the other: it goes there, and misses.
    assert sticky_lru_hit_ratio([a, b, c], 4, [100, 100]) == 8 / 48
    assert compute_oracle([a, b, c], 4, [100, 100]).infinite == 16 / 48


# An independent model of vLLM 0.32's block pool (and the mock's PagedKvCache): slots keyed by their whole token
# prefix (no hashes), found by scanning; one slot kept back as the null block; a free list where a finished
# request's slots go tail first, those caching nothing to the front (reused first), cached ones to the back.


@dataclass
class Slot:
    key: tuple[int, ...] | None = None
    cached_at: int = 0  # a hash cached twice: lookups take the copy cached first
    refs: int = 0


@dataclass
class Pod:
    slots: list[Slot]
    free: list[int] = field(default_factory=list)
    sessions: int = 0

    def find(self, key: tuple[int, ...]) -> int | None:
        copies = [i for i, s in enumerate(self.slots) if s.key == key]
        return min(copies, key=lambda i: self.slots[i].cached_at) if copies else None

    def cached_prefix(self, tokens: list[int], bs: int, may_hit: int) -> list[int]:
        found: list[int] = []
        while len(found) < may_hit and (slot := self.find(tuple(tokens[: (len(found) + 1) * bs]))) is not None:
            found.append(slot)
        return found


def brute_force_sticky(requests: list[OracleRequest], bs: int, capacities: list[int]) -> float:
    pods = [Pod([Slot() for _ in range(c - 1)], list(range(c - 1))) for c in capacities]
    pod_of: dict[int, Pod] = {}
    clock = queries = hits = 0
    for r in requests:
        if -(-(r.prompt_len + r.max_tokens) // bs) > min(capacities) - 1:  # the smallest pod would refuse it
            continue
        may_hit = (r.prompt_len - 1) // bs
        if r.session not in pod_of:
            least = min(p.sessions for p in pods)
            best = max((p for p in pods if p.sessions <= least + 1),
                       key=lambda p: (len(p.cached_prefix(r.tokens, bs, may_hit)), -p.sessions, -pods.index(p)))
            best.sessions += 1
            pod_of[r.session] = best
        pod = pod_of[r.session]
        hit = pod.cached_prefix(r.tokens, bs, may_hit)
        queries += r.prompt_len
        hits += len(hit) * bs
        for i in hit:
            pod.free.remove(i)
            pod.slots[i].refs += 1
        blocks = list(hit)
        for _ in range(-(-len(r.tokens) // bs) - len(hit)):
            i = pod.free.pop(0)
            pod.slots[i] = Slot(refs=1)
            blocks.append(i)
        for j in range(len(hit), len(r.tokens) // bs):
            clock += 1
            pod.slots[blocks[j]].key, pod.slots[blocks[j]].cached_at = tuple(r.tokens[: (j + 1) * bs]), clock
        uncached = []
        for i in reversed(blocks):
            pod.slots[i].refs -= 1
            if not pod.slots[i].refs:
                (uncached if pod.slots[i].key is None else pod.free).append(i)
        pod.free[:0] = uncached
    return hits / queries if queries else 0.0


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[OracleRequest], int, list[int]]:
    """A few sessions over a tiny alphabet (so prefixes are shared, within and across sessions), each
    request extending its session's last prompt or starting over, in a random interleaving."""
    bs = draw(st.integers(1, 4))
    sessions = draw(st.integers(1, 4))
    prompts: list[list[int]] = [[] for _ in range(sessions)]
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        s = draw(st.integers(0, sessions - 1))
        grow = draw(st.lists(st.integers(0, 2), min_size=1, max_size=10))
        prompts[s] = (prompts[s] if draw(st.booleans()) else []) + grow
        max_tokens = draw(st.integers(1, 3))
        answer = draw(st.lists(st.integers(0, 2), min_size=max_tokens, max_size=max_tokens))
        requests.append(req(s, list(prompts[s]), max_tokens, answer))
    capacities = draw(st.lists(st.integers(2, 12), min_size=1, max_size=3))
    return requests, bs, capacities


@settings(max_examples=300, deadline=None)
@given(traces())
def test_sticky_lru_is_the_brute_force_model_and_never_beats_the_infinite_cache(case):
    requests, bs, capacities = case
    sticky = sticky_lru_hit_ratio(requests, bs, capacities)
    assert sticky == brute_force_sticky(requests, bs, capacities)
    infinite = infinite_hit_ratio(requests, bs, min(capacities))
    assert sticky <= infinite + 1e-12
    # Evicting farthest next use first never hits less than LRU at the same placement, nor more than infinite.
    assert sticky - 1e-12 <= keep_warm_hit_ratio(requests, bs, capacities) <= infinite + 1e-12
