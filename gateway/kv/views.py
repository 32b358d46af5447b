"""What the prefix index keeps of each engine (its views, and those a process knows: :class:`EngineViews`) and
says of a prompt on a pod (a match), and the walks that find how far a prompt's blocks run in a view.

A view is a handle on its record in a :class:`~gateway.kv._blockindex.BlockIndex`, whose fields the index's
writer (:class:`~gateway.kv.index.PrefixIndex`) sets; the walks only read a block index.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from gateway.kv._blockindex import BlockIndex
from gateway.kv.hashing import PromptHashes

# BlockIndex.view_field's fields.
BLOCK_SIZE, APPROXIMATE, LAST_SEQ, GPU_BLOCKS, BLOCKS, ORPHANS, EVICTIONS, ENGINE_HASHES = range(8)


@dataclass(slots=True)
class IndexStats:
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    unknown_parent: int = 0
    unknown_removed: int = 0
    rejected: int = 0  # malformed BlockStored (token count mismatch, lookahead tokens)
    evicted_for_memory: int = 0


def _field(field: int, doc: str | None = None, *, settable: str | None = None) -> property:
    """An :class:`EngineView` property reading its ``field`` in the block index (and, where ``settable``
    names it for ``BlockIndex.set_view``, writing it)."""

    def read(view: EngineView) -> int:
        return view.store.view_field(view.bit, field)

    def write(view: EngineView, value: int) -> None:
        view.store.set_view(view.bit, **{settable: value})

    return property(read, write if settable else None, doc=doc)


class EngineView:
    """What the gateway knows of one engine process: a pod's DP rank, until it restarts. A handle on its
    record in a block index (``bit``: its id there), whose fields the index's writer sets."""

    __slots__ = ("bit", "model", "pod", "rank", "store")

    def __init__(self, store: BlockIndex, bit: int, pod: str, rank: int, model: str) -> None:
        self.store, self.bit, self.pod, self.rank, self.model = store, bit, pod, rank, model

    @property
    def key(self) -> tuple[str, int]:
        return (self.pod, self.rank)

    @property
    def block_size(self) -> int | None:
        return self.store.view_field(self.bit, BLOCK_SIZE) or None

    @block_size.setter
    def block_size(self, value: int | None) -> None:
        self.store.set_view(self.bit, block_size=value or 0)

    approximate = _field(APPROXIMATE, "Events of the view were lost for good: routing trusts it less until a clean "
                         "base returns.", settable="approximate")
    last_seq = _field(LAST_SEQ, settable="last_seq")
    blocks = _field(BLOCKS, "Distinct blocks held in any tier.")
    gpu_blocks = _field(GPU_BLOCKS)
    orphans = _field(ORPHANS, "Held GPU blocks whose parent the view does not hold (0: what it holds is closed "
                     "under prefixes).")
    evictions = _field(EVICTIONS, "BlockRemoved blocks: the engine reused a cached block's slot.")
    engine_hashes = _field(ENGINE_HASHES)


class EngineViews:
    """The views this process knows over its block indexes, by (pod, rank), by pod, and per index by bit.
    Owner: a writer's are added by :meth:`~gateway.kv.index.PrefixIndex.view` and dropped with their pod, a
    reader (``writes`` false) learns them from the writers' files in :meth:`sync`. Read by the index's
    lookups, which call :meth:`sync` first; the other accessors sync themselves."""

    def __init__(self, stores: list[BlockIndex], writes: bool) -> None:
        self._stores, self.writes = stores, writes
        self.by_key: dict[tuple[str, int], EngineView] = {}
        self.by_pod: dict[str, list[EngineView]] = {}
        self.pod_of_bit: dict[BlockIndex, dict[int, str]] = {}
        self._version: tuple[int, ...] = ()

    def add(self, view: EngineView) -> EngineView:
        self.by_key[view.key] = view
        self.by_pod.setdefault(view.pod, []).append(view)
        self.pod_of_bit.setdefault(view.store, {})[view.bit] = view.pod
        return view

    def drop(self, pod: str) -> None:
        """Forget the pod's views (a writer drops them from its block index too)."""
        for view in self.by_pod.pop(pod, []):
            del self.by_key[view.key]
            self.pod_of_bit.get(view.store, {}).pop(view.bit, None)
            if self.writes:
                view.store.drop_view(view.bit)

    def sync(self) -> None:
        """A reader learns the views from the writers', when they changed."""
        if self.writes or (version := tuple(s.views_version() for s in self._stores)) == self._version:
            return
        known, self.by_key, self.by_pod, self.pod_of_bit = self.by_key, {}, {}, {}
        for store in self._stores:
            for bit, pod, rank in store.views()[1]:
                was = known.get((pod, rank))
                self.add(was if was is not None and was.bit == bit and was.store is store
                         else EngineView(store, bit, pod, rank, ""))
        self._version = version

    def of(self, pod: str) -> list[EngineView]:
        self.sync()
        return self.by_pod.get(pod, [])

    def rank0(self, pod: str) -> EngineView | None:
        self.sync()
        return self.by_key.get((pod, 0))


@dataclass(slots=True)
class PodMatch:
    """Cached tokens of the prompt's prefix on one pod (the best of its ranks)."""

    gpu_tokens: int = 0
    offload_tokens: int = 0  # beyond the GPU run, found in the offload tier
    speculative_tokens: int = 0  # of ``gpu_tokens``, expected from recent routing but not yet confirmed
    approximate: bool = False


class EvictionListener(Protocol):
    """Told what the pods' events say their LRU did (:class:`~gateway.kv.free_queue.FreeQueues`)."""

    def evicted(self, pod: str, blocks: Iterable[int]) -> None: ...

    def cleared(self, pod: str, blocks: Iterable[int]) -> None: ...

    def dropped(self, pod: str) -> None: ...


def leading_runs(store: BlockIndex, bits: list[int], prompt: PromptHashes, bs: int, usable: int) -> list[int]:
    """Each view's run of leading blocks on its GPU tier: each pass checks the last of the hashes known so far
    (bisecting below it when it is not held, or walking a view with orphans); the views whose run reached it
    go on with twice as many; the prompt is hashed no further than about twice the longest run."""
    count = min(usable, 16)
    runs = store.runs(bits, None, prompt.first(bs, count), count)
    going = [i for i, run in enumerate(runs) if run == count < usable]
    while going:
        count = min(usable, 2 * count)
        more = store.runs([bits[i] for i in going], [runs[i] for i in going], prompt.first(bs, count), count)
        for i, run in zip(going, more, strict=True):
            runs[i] = run
        going = [i for i in going if runs[i] == count < usable]
    return runs


def walk(store: BlockIndex, bit: int, prompt: PromptHashes, bs: int, usable: int, start: int = 0,
         any_tier: bool = False, closed: bool = False) -> int:
    """The run from ``start`` on, on the GPU tier (or either tier): block by block, or bisected over a view
    closed under prefixes (``closed``). Each pass checks the hashes known so far, twice as many as the last;
    the prompt is hashed no further than about twice the run."""
    i, count = start, min(usable, start + (16 if closed else 8))
    while True:
        i = store.run(bit, prompt.first(bs, count), i, count, not closed, any_tier)
        if i < count or count >= usable:
            return i
        count = min(usable, 2 * count)
