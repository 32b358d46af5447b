"""The prefix index against hand-built event sequences, in every encoding the engines use.

The tests taking the ``index`` fixture are the contract every prefix index implementation passes:
the gateway's, and a plain reference one (``tests/kv_reference.py``) that also checks, on random event
sequences, that the gateway's gives the same answers. A new one (say, an index shared by many gateway
processes) adds its factory to ``IMPLEMENTATIONS``.
The tests taking ``in_memory`` check the in-memory layout's own bounds and bookkeeping.
"""

from __future__ import annotations

import tempfile
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.kv._blockindex import BlockIndex, hash64
from gateway.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoding,
    EventBatch,
    decode_batch,
    encode_batch,
)
from gateway.kv.hashing import namespace_root, prefix_hashes
from gateway.kv.index import PrefixIndex
from tests.kv_reference import ReferenceIndex, chain_hash
from tests.kv_reference import hash64 as reference_hash64
from tests.kv_reference import namespace_root as reference_root

BS = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks, and the engine may hit at most 16 tokens


def stored(hashes, parent, tokens, **kw) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, **kw)


def through_wire(events, encoding: Encoding):
    return decode_batch(encode_batch(EventBatch(1.0, events, 0), encoding)).events


class SharedIndex:
    """A writer applying the events to files and a reader answering from them, as a host's indexer and a
    worker are (in one process here: ``tests/integration/test_host_index.py`` has them apart)."""

    WRITES = ("view", "apply", "apply_payload", "reset_view", "drop_pod", "mark_approximate", "max_blocks_per_view")

    def __init__(self, **options) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvgw-index-")
        path = f"{self._dir.name}/index"
        ttl = options.pop("speculative_ttl_s", 2.0)
        self.writer = PrefixIndex(stores=[BlockIndex(path=path, ring=1024)], speculative_ttl_s=0, **options)
        self.reader = PrefixIndex(stores=[BlockIndex(path=path, writer=False)], speculative_ttl_s=ttl)

    def __getattr__(self, name: str):
        return getattr(self.writer if name in self.WRITES else self.reader, name)


IMPLEMENTATIONS = {"in_memory": PrefixIndex, "reference": ReferenceIndex, "shared": SharedIndex}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    return IMPLEMENTATIONS[request.param]()


@pytest.fixture
def in_memory() -> PrefixIndex:
    return PrefixIndex()


def match(index: PrefixIndex, tokens=PROMPT, pods=("a", "b"), lora=None):
    return {p: m.gpu_tokens for p, m in index.lookup("m", lora, tokens, pods).items()}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), st.integers(0, 2**64 - 1))
def test_the_native_hash_is_the_one_written_out_in_python(data, seed):
    assert hash64(data, seed) == reference_hash64(data, seed)
    assert hash64(memoryview(data), seed) == hash64(bytearray(data), seed) == hash64(data, seed)


def test_prompt_and_event_hashes_are_the_reference_chain_and_tell_near_inputs_apart():
    tokens = list(range(7, 7 + 5 * BS))
    root = namespace_root("m", "adapter")
    assert root == reference_root("m", "adapter") != namespace_root("m") == reference_root("m")
    expected, parent = [], root
    for i in range(5):
        parent = chain_hash(parent, tokens[i * BS:(i + 1) * BS])
        expected.append(parent)
    assert prefix_hashes(root, tokens, BS) == expected
    # One bit apart, one word apart, or only longer: every one a different hash.
    near = {bytes(32), b"\x01" + bytes(31), bytes(31) + b"\x80", bytes(24) + b"\x01" + bytes(7), bytes(33)}
    assert len({hash64(d) for d in near}) == len(near)
    assert len({hash64(b"x", seed) for seed in range(1000)}) == 1000
    with pytest.raises(OverflowError):
        hash64(b"x", -1)
    with pytest.raises(TypeError):
        hash64("text")


@pytest.mark.parametrize("encoding", list(Encoding))
def test_chain_across_batches_in_every_encoding(index, encoding):
    view = index.view("a", 0, "m", BS)
    index.apply(view, through_wire([stored([11, 12], None, PROMPT[:8])], encoding))
    assert match(index) == {"a": 8, "b": 0}
    index.apply(view, through_wire([stored([13, 14], 12, PROMPT[8:16])], encoding))
    assert match(index) == {"a": 16, "b": 0}  # capped: the 17th token is never a hit
    assert match(index, PROMPT[:16]) == {"a": 12, "b": 0}  # 16 tokens: the last block holds the last token
    # The own hashes are the gateway's chained hashes of the tokens, whatever the engine's hashes were.
    assert index.own_hashes("a") == set(prefix_hashes(namespace_root("m"), PROMPT[:16], BS))


def test_engine_hashes_do_not_matter_across_pods(index):
    a, b = index.view("a", 0, "m", BS), index.view("b", 0, "m", BS)
    index.apply(a, [stored([1, 2], None, PROMPT[:8])])
    index.apply(b, [stored([-77, 2**64 - 1], None, PROMPT[:8])])  # another seed; SGLang's signed ints
    assert match(index) == {"a": 8, "b": 8}


def test_longest_run_from_the_first_block(index):
    view = index.view("a", 0, "m", BS)
    index.apply(view, [stored([1, 2, 3], None, PROMPT[:12])])
    index.apply(view, [BlockRemoved([2])])
    assert match(index) == {"a": 4, "b": 0}  # block 3 is still held, but the run broke at block 2
    other = [999, *PROMPT[1:]]
    assert match(index, other) == {"a": 0, "b": 0}


def test_duplicates_are_reference_counted(index):
    view = index.view("a", 0, "m", BS)
    index.apply(view, [stored([1, 2], None, PROMPT[:8]), stored([1, 2], None, PROMPT[:8])])
    index.apply(view, [BlockRemoved([1, 2])])
    assert match(index) == {"a": 8, "b": 0}  # the second copy still holds the prefix
    index.apply(view, [BlockRemoved([1, 2])])
    assert match(index) == {"a": 0, "b": 0}
    index.apply(view, [BlockRemoved([1])])  # a third removal has nothing left to remove
    assert index.stats.unknown_removed == 1


def test_clear_and_restart_drop_the_view_only(index):
    a, b = index.view("a", 0, "m", BS), index.view("b", 0, "m", BS)
    for view in (a, b):
        index.apply(view, [stored([1, 2], None, PROMPT[:8])])
    index.apply(a, [AllBlocksCleared()])
    assert match(index) == {"a": 0, "b": 8}
    index.apply(a, [stored([3], 2, PROMPT[8:12])])  # its engine map was cleared too: parent unknown
    assert index.stats.unknown_parent == 1 and match(index) == {"a": 0, "b": 8}
    index.reset_view(b)
    assert match(index) == {"a": 0, "b": 0} and index.size() == 0


def test_lora_and_extra_keys_never_match_plain_blocks(index):
    view = index.view("a", 0, "m", BS)
    index.apply(view, [stored([1, 2], None, PROMPT[:8], lora_name="sql", lora_id=1)])
    assert match(index) == {"a": 0, "b": 0}
    assert match(index, lora="sql") == {"a": 8, "b": 0}
    index.apply(view, [stored([5, 6], None, PROMPT[:8], extra_keys=[["salt-1"], None])])
    assert match(index) == {"a": 0, "b": 0}  # a salted first block poisons the whole chain


def test_an_adapters_blocks_match_its_prompts_as_vllm_marks_them(index):
    # vLLM 0.32 leads each LoRA block's extra keys with the adapter's name, the event's lora_name.
    view = index.view("a", 0, "m", BS)
    index.apply(view, [stored([1, 2], None, PROMPT[:8], lora_name="sql", lora_id=1, extra_keys=[["sql"], ["sql"]])])
    assert match(index, lora="sql") == {"a": 8, "b": 0}
    assert match(index) == {"a": 0, "b": 0} and match(index, lora="other") == {"a": 0, "b": 0}
    index.apply(view, [stored([7, 8], None, PROMPT[:8], lora_name="sql", extra_keys=[["sql", "salt"], ["sql"]])])
    assert match(index, lora="sql") == {"a": 8, "b": 0}  # the salted copy is another chain


def test_malformed_stores_are_rejected(index):
    view = index.view("a", 0, "m", BS)
    index.apply(view, [stored([1, 2], None, PROMPT[:7])])  # token count does not fill the blocks
    index.apply(view, [stored([1], None, PROMPT[:4], lookahead_token_ids=[5])])
    index.apply(view, [stored([1], None, [-1, *PROMPT[1:4]])])  # token ids are uint32
    index.apply(view, [stored([1], None, [1 << 32, *PROMPT[1:4]])])
    assert index.stats.rejected == 4 and match(index) == {"a": 0, "b": 0}


def test_offload_tier_counts_separately(index):
    view = index.view("a", 0, "m", BS)
    index.apply(view, [stored([1], None, PROMPT[:4]), stored([2, 3], 1, PROMPT[4:12], medium="CPU")])
    m = index.lookup("m", None, PROMPT, ["a"])["a"]
    assert (m.gpu_tokens, m.offload_tokens) == (4, 8)
    index.apply(view, [BlockRemoved([2, 3], medium="CPU")])
    m = index.lookup("m", None, PROMPT, ["a"])["a"]
    assert (m.gpu_tokens, m.offload_tokens) == (4, 0)


def test_block_sizes_learned_per_pod(index):
    a, b = index.view("a", 0, "m"), index.view("b", 0, "m", 8)
    index.apply(a, [stored([1, 2], None, PROMPT[:8])])
    index.apply(b, [BlockStored([9, 10], None, PROMPT[:16], 8)])
    assert a.block_size == 4 and match(index) == {"a": 8, "b": 16}


def test_best_rank_wins_and_approximate_is_reported(index):
    r0, r1 = index.view("a", 0, "m", BS), index.view("a", 1, "m", BS)
    index.apply(r0, [stored([1], None, PROMPT[:4])])
    index.apply(r1, [stored([1, 2, 3], None, PROMPT[:12])])
    r1.approximate = True
    m = index.lookup("m", None, PROMPT, ["a"])["a"]
    assert m.gpu_tokens == 12 and m.approximate


def test_speculative_insertion_expires():
    for factory in IMPLEMENTATIONS.values():
        check_speculative_insertion_expires(factory(speculative_ttl_s=0.05))


def check_speculative_insertion_expires(index: PrefixIndex) -> None:
    view = index.view("a", 0, "m", BS)
    index.expect("a", "m", None, PROMPT)
    m = index.lookup("m", None, PROMPT, ["a", "b"])
    assert m["a"].gpu_tokens == 16 and m["a"].speculative_tokens == 16 and m["b"].gpu_tokens == 0
    index.apply(view, [stored([1], None, PROMPT[:4])])
    assert index.lookup("m", None, PROMPT, ["a"])["a"].speculative_tokens == 12
    time.sleep(0.06)
    index.expect("b", "m", None, [1, 2, 3, 4, 5])  # any later insertion sweeps expired entries
    assert match(index) == {"a": 4, "b": 0}


def test_expired_speculative_entries_are_swept(in_memory):
    index = in_memory
    index.speculative_ttl_s = 0.05
    index.view("a", 0, "m", BS)
    index.expect("a", "m", None, PROMPT)
    assert len(index._speculative) == 4
    time.sleep(0.06)
    index.expect("b", "m", None, [1, 2, 3, 4, 5])  # any later insertion sweeps expired entries
    assert len(index._speculative) == 0


def test_memory_bound_forgets_least_recent(in_memory):
    index = in_memory
    index.max_blocks_per_view = 100
    view = index.view("a", 0, "m", BS)
    parent = None
    for i in range(60):
        tokens = list(range(i * 8, i * 8 + 8))
        index.apply(view, [stored([2 * i + 1, 2 * i + 2], None, tokens)])
        parent = 2 * i + 2
    assert parent and view.blocks <= 100 and index.stats.evicted_for_memory > 0
    assert index.lookup("m", None, list(range(59 * 8, 59 * 8 + 9)), ["a"])["a"].gpu_tokens == 8  # newest kept
    assert index.lookup("m", None, list(range(0, 9)), ["a"])["a"].gpu_tokens == 0  # oldest forgotten


def test_drop_pod_frees_its_bit(in_memory):
    index = in_memory
    a = index.view("a", 0, "m", BS)
    index.apply(a, [stored([1, 2], None, PROMPT[:8])])
    index.drop_pod("a")
    c = index.view("c", 0, "m", BS)
    assert c.bit == a.bit and match(index, pods=("a", "c")) == {"a": 0, "c": 0}


def test_garbage_payloads_are_rejected_or_skipped():
    from gateway.kv.events import BadEventBatch

    with pytest.raises(BadEventBatch):
        decode_batch(b"\xc1 not msgpack")
    with pytest.raises(BadEventBatch):
        decode_batch(b"\x93\x01\x02\x03")  # [1, 2, 3]: events is not a list
    import msgspec

    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": "nope"}, ["Mystery", 1],
                                            {"type": "BlockRemoved", "block_hashes": [1]}, 42]])
    batch = decode_batch(payload)
    assert batch.skipped == 3 and batch.events == [BlockRemoved([1])]


@st.composite
def event_sequences(draw: st.DrawFn) -> list[tuple[tuple[str, int], list]]:
    """Batches for a few views: chains of stores growing from known (and sometimes unknown) parents,
    duplicates, removals in either tier, clears; tokens from a small alphabet so prefixes are shared."""
    batches = []
    known: dict[tuple[str, int], list[int]] = {}
    next_hash = 1
    for _ in range(draw(st.integers(1, 25))):
        view = draw(st.sampled_from([("a", 0), ("a", 1), ("b", 0)]))
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
        hashes = known.setdefault(view, [])
        if kind == "store":
            n = draw(st.integers(1, 3))
            parent = draw(st.one_of(st.none(), st.sampled_from(hashes) if hashes else st.none(), st.just(-5)))
            new = list(range(next_hash, next_hash + n)) if draw(st.booleans()) or not hashes else \
                draw(st.lists(st.sampled_from(hashes), min_size=n, max_size=n))  # duplicates of stored ones
            next_hash += n
            tokens = draw(st.lists(st.integers(0, 2), min_size=n * BS, max_size=n * BS))
            hashes.extend(new)
            batches.append((view, [stored(new, parent, tokens, medium=draw(st.sampled_from(["GPU", "CPU"])))]))
        elif kind == "remove" and hashes:
            gone = draw(st.lists(st.sampled_from(hashes), min_size=1, max_size=3))
            batches.append((view, [BlockRemoved(gone, medium=draw(st.sampled_from(["GPU", "CPU"])))]))
        elif kind == "clear":
            batches.append((view, [AllBlocksCleared()]))
    return batches


prompts_of_blocks = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(batches=event_sequences(), prompts=prompts_of_blocks,
       expected=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(st.integers(0, 2), max_size=20),
                                   st.integers(0, 12)), max_size=3))
def test_the_gateways_index_agrees_with_the_reference_on_any_event_sequence(batches, prompts, expected):
    """Any stores, duplicates, removals (holes in the middle of a prefix included), clears, tiers and
    speculative insertions: the same answers as the plainest implementation."""
    ours, reference = PrefixIndex(speculative_ttl_s=60), ReferenceIndex(speculative_ttl_s=60)
    for index in (ours, reference):
        views = {key: index.view(*key, "m", BS) for key in (("a", 0), ("a", 1), ("b", 0))}
        for key, events in batches:
            index.apply(views[key], events)
        for pod, tokens, confirmed in expected:
            index.expect(pod, "m", None, tokens, confirmed_tokens=confirmed)
    for prompt in prompts:
        assert ours.lookup("m", None, prompt, ["a", "b"]) == reference.lookup("m", None, prompt, ["a", "b"]), prompt
    for key in (("a", 0), ("a", 1), ("b", 0)):
        assert ours.own_hashes(*key) == reference.own_hashes(*key)
    assert ours.stats == reference.stats


class Notes:
    """An eviction listener that writes down what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str, list[int]]] = []

    def evicted(self, pod, blocks):
        self.told.append(("evicted", pod, list(blocks)))

    def cleared(self, pod, blocks):
        self.told.append(("cleared", pod, sorted(blocks)))

    def dropped(self, pod):
        self.told.append(("dropped", pod, []))


@settings(max_examples=300, deadline=None)
@given(batches=event_sequences(), prompts=prompts_of_blocks,
       encoding=st.sampled_from([Encoding.CURRENT, Encoding.SGLANG, Encoding.V0_23]))
def test_batches_decoded_natively_give_what_decoded_events_give(batches, prompts, encoding):
    """The native decoder (the current and SGLang forms; older ones fall back to msgspec) applies a batch off
    the wire exactly as its decoded events are applied: the same blocks, counters and eviction notices."""
    wire_notes, event_notes = Notes(), Notes()
    wire, events_index = PrefixIndex(evictions=wire_notes), PrefixIndex(evictions=event_notes)
    for index in (wire, events_index):
        views = {key: index.view(*key, "m", BS) for key in (("a", 0), ("a", 1), ("b", 0))}
        for key, events in batches:
            if index is wire:
                assert index.apply_payload(views[key], encode_batch(EventBatch(1.0, events, 0), encoding)) == 0
            else:
                index.apply(views[key], events)
    for prompt in prompts:
        assert wire.lookup("m", None, prompt, ["a", "b"]) == events_index.lookup("m", None, prompt, ["a", "b"])
    for key in (("a", 0), ("a", 1), ("b", 0)):
        assert wire.own_hashes(*key) == events_index.own_hashes(*key)
        assert wire.view(*key, "m").orphans == events_index.view(*key, "m").orphans
    assert wire.stats == events_index.stats and wire_notes.told == event_notes.told


def test_a_large_index_grows_its_tables_and_keeps_every_answer():
    """Thousands of blocks over many views: the tables are rebuilt larger several times (and emptied by removals
    and clears); every lookup still agrees with the reference."""
    import random

    rng = random.Random(7)
    ours, reference = PrefixIndex(), ReferenceIndex()
    prompts = [[rng.randrange(50) for _ in range(BS * rng.randrange(1, 40))] for _ in range(60)]
    engine_hash = 1
    for index in (ours, reference):
        rng = random.Random(8)
        engine_hash = 1
        views = [index.view(f"pod{i}", 0, "m", BS) for i in range(40)]
        stored_by: dict[int, list[list[int]]] = {}
        for _ in range(1500):
            v = rng.randrange(len(views))
            if rng.random() < 0.8 or not stored_by.get(v):
                prompt = rng.choice(prompts)
                hashes = list(range(engine_hash, engine_hash + len(prompt) // BS))
                engine_hash += len(hashes)
                index.apply(views[v], [stored(hashes, None, prompt)])
                stored_by.setdefault(v, []).append(hashes)
            elif rng.random() < 0.97:
                hashes = stored_by[v].pop(rng.randrange(len(stored_by[v])))
                index.apply(views[v], [BlockRemoved(hashes[::-1])])
            else:
                index.apply(views[v], [AllBlocksCleared()])
                stored_by[v] = []
    assert ours.memory()["generations"][0] > 3 and ours.size() > 2000
    pods = [f"pod{i}" for i in range(40)]
    for prompt in prompts:
        assert ours.lookup("m", None, [*prompt, 1], pods) == reference.lookup("m", None, [*prompt, 1], pods)
    assert ours.stats == reference.stats and ours.size() == reference.size()


def test_holders_name_the_pods_with_the_longest_runs_first(in_memory):
    index = in_memory
    a, b, c = (index.view(p, 0, "m", BS) for p in "abc")
    index.apply(a, [stored([1, 2, 3, 4], None, PROMPT[:16])])
    index.apply(b, [stored([1], None, PROMPT[:4])])
    index.apply(c, [stored([1], None, [7, 7, 7, 7])])
    holders = index.holders(index.prompt_hashes("m", None, PROMPT), limit=8)
    assert holders == ["a", "b"]  # c holds another prompt's first block: not a candidate
    assert index.holders(index.prompt_hashes("m", None, PROMPT), limit=1) == ["a"]
    index.apply(a, [BlockRemoved([4, 3, 2, 1])])
    assert index.holders(index.prompt_hashes("m", None, PROMPT), limit=8) == ["b"]
    index.expect("c", "m", None, PROMPT)  # just routed there: a candidate before its events say so
    assert set(index.holders(index.prompt_hashes("m", None, PROMPT), limit=8)) == {"b", "c"}


def test_a_closed_view_is_bisected_and_the_prompt_hashed_no_further_than_needed(in_memory):
    index = in_memory
    view = index.view("a", 0, "m", BS)
    prompt = list(range(4000))
    index.apply(view, [stored(list(range(1, 101)), None, prompt[:400])])  # the first 100 of 999 blocks
    hashes = index.prompt_hashes("m", None, prompt)
    assert index.lookup("m", None, hashes, ["a"])["a"].gpu_tokens == 400
    assert view.orphans == 0 and hashes.known(BS) <= 2 * 100 + 1  # galloping past the run, not to the end
    assert index.lookup("m", None, list(range(10_000, 14_000)), ["a"])["a"].gpu_tokens == 0


def test_a_view_that_lost_a_parent_is_walked_block_by_block(in_memory):
    index = in_memory
    view = index.view("a", 0, "m", BS)
    index.apply(view, [stored([1, 2, 3, 4], None, PROMPT[:16])])
    index.apply(view, [BlockRemoved([2])])  # a hole: blocks 3 and 4 are held without their parent
    assert view.orphans == 1 and match(index) == {"a": 4, "b": 0}
    index.apply(view, [stored([2], 1, PROMPT[4:8])])  # the parent again: closed once more
    assert view.orphans == 0 and match(index) == {"a": 16, "b": 0}
    index.apply(view, [BlockRemoved([4, 3, 2])])  # evicted children first, as engines do
    assert view.orphans == 0 and match(index) == {"a": 4, "b": 0}


def test_a_reader_follows_the_writers_evictions_and_clears_and_counts_what_the_ring_lost(tmp_path):
    path = str(tmp_path / "index")
    writer = PrefixIndex(stores=[BlockIndex(path=path, ring=8)])
    notes = Notes()
    reader = PrefixIndex(stores=[BlockIndex(path=path, writer=False)], evictions=notes)
    a = writer.view("a", 0, "m", BS)
    assert reader.follow_notes() == 0  # from now on
    writer.apply(a, [stored([1, 2, 3, 4], None, PROMPT[:16])])
    writer.apply(a, [BlockRemoved([4, 3])])
    assert reader.follow_notes() == 2
    owns = prefix_hashes(namespace_root("m"), PROMPT[:16], BS)
    assert notes.told == [("evicted", "a", [owns[3], owns[2]])]
    writer.apply(a, [AllBlocksCleared()])
    reader.follow_notes()
    assert notes.told[-1] == ("cleared", "a", sorted(owns[:2]))
    for i in range(6):  # 12 notes into a ring of 8: the oldest 4 are gone before the reader looks
        writer.apply(a, [stored([10 + i, 20 + i], None, PROMPT[:8]), BlockRemoved([20 + i, 10 + i])])
    assert reader.follow_notes() == 8 and reader.notes_lost == 4


def test_a_reader_maps_each_new_generation_and_a_restarted_writer_empties_it(tmp_path):
    path = str(tmp_path / "index")
    writer = PrefixIndex(stores=[BlockIndex(path=path)])
    reader = PrefixIndex(stores=[BlockIndex(path=path, writer=False)])
    pods = [f"pod{i}" for i in range(20)]
    prompts = {pod: [i * 1000 + t for t in range(BS * 300)] for i, pod in enumerate(pods)}
    for pod in pods:  # 6,000 blocks: the tables are rebuilt, each time in a new file, several times
        writer.apply(writer.view(pod, 0, "m", BS), [stored(list(range(1, 301)), None, prompts[pod])])
    assert writer.memory()["generations"][0] > 3
    for pod in pods:
        assert reader.lookup("m", None, [*prompts[pod], 1], pods)[pod].gpu_tokens == 300 * BS
    assert reader.size() == writer.size() == 6000 and reader.holders(
        reader.prompt_hashes("m", None, prompts["pod3"]), limit=4) == ["pod3"]
    PrefixIndex(stores=[BlockIndex(path=path)])  # the writer restarted: it starts from nothing, in the same file
    assert reader.size() == 0 and reader.views() == [] and reader.lookup("m", None, prompts["pod3"], ["pod3"])[
        "pod3"].gpu_tokens == 0
