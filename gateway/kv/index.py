"""The prefix index: which token blocks each pod (and DP rank) holds, keyed by the gateway's own hash.

Owner: written only by the KV-event subscribers (through :meth:`PrefixIndex.apply_payload` and
:meth:`PrefixIndex.apply`) and by the pipeline's speculative insertion (the ``RoutedPrefix`` dispatch step,
through :meth:`PrefixIndex.expect`, into :class:`ExpectedBlocks`); read by routing through
:meth:`PrefixIndex.lookup` and :meth:`PrefixIndex.holders` (its :class:`PrefixLookup`). Its speculative blocks go
to the other workers and replicas through the sink it is built with, theirs come in through ``apply_remote``.

The blocks themselves live in a :class:`~gateway.kv._blockindex.BlockIndex` (``gateway/kv/native/``): in
this process's memory, or, with several workers, in files every process of the host maps, written by the
host's indexer (:mod:`gateway.indexer`) and read here without copying (a *reader* index: it applies no
events and learns the views from the files). Per (block, view) it keeps the copies per tier (vLLM stores
duplicates; each copy is stored and removed) and, per block, which views hold it (for the candidates of a
lookup that does not look at every pod).

Engines evict a cached block only after its descendants (vLLM frees a finished request's blocks tail
first and evicts least recently freed first; SGLang evicts radix-tree leaves), so what one holds is closed
under prefixes: if a prompt's block ``i`` is held, so are all before it. A lookup then gallops and
bisects over the prompt's chained hashes for the end of the held run. Whether a view is so closed is
tracked, not assumed: each view counts its *orphans* (held GPU blocks whose parent it does not hold), and
a view with any (lost events, the memory bound) is walked block by block.

A block whose every copy a view removed is forgotten with its engine hash: an event naming it as a parent
later is an unknown parent (engines name as parent only a block the request holds, so this happens only
after lost events).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from gateway.core.facts import BlocksExpected, Publish, unshared
from gateway.kv._blockindex import BlockIndex
from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, decode_batch
from gateway.kv.hashing import PromptHashes, extra_key_bytes, namespace_root, prefix_hashes
from gateway.kv.views import (
    APPROXIMATE,
    BLOCK_SIZE,
    EngineView,
    EngineViews,
    EvictionListener,
    IndexStats,
    PodMatch,
    leading_runs,
    walk,
)

log = logging.getLogger("gateway.kv.index")

_GPU_MEDIA = (None, "GPU", "gpu")


class ExpectedBlocks:
    """Speculative blocks: those just routed to a pod's rank-0 view (by this process, or by a peer over the bus),
    expected there until their expiry, before its events confirm them; this process's own, not in the block
    index. Owner: written by :meth:`PrefixIndex.expect` and :meth:`PrefixIndex.apply_remote` (each sweeps the
    expired first); read by :class:`PrefixLookup`."""

    def __init__(self) -> None:
        self._expiries: dict[int, dict[int, float]] = {}  # own hash → {view bit: expiry}
        self._queue: deque[tuple[float, int, list[int]]] = deque()  # what to sweep, in order of expiry

    def __len__(self) -> int:
        return len(self._expiries)

    def add(self, bit: int, hashes: list[int], expiry: float) -> None:
        for h in hashes:
            self._expiries.setdefault(h, {})[bit] = expiry
        self._queue.append((expiry, bit, hashes))

    def sweep(self, now: float) -> None:
        queue, expiries = self._queue, self._expiries
        while queue and queue[0][0] <= now:
            _, bit, hashes = queue.popleft()
            for h in hashes:
                expected = expiries.get(h)
                if expected is not None and expected.get(bit, now + 1) <= now:
                    del expected[bit]
                    if not expected:
                        del expiries[h]

    def run(self, store: BlockIndex, bit: int, prompt: PromptHashes, bs: int, usable: int, start: int,
            now: float) -> int:
        """From the end of the view's confirmed run (``start``), the run of blocks expected on the view until
        past ``now`` or held on its GPU tier: ``start`` unless the block there is expected."""
        expiries = self._expiries
        expected = expiries.get(prompt.first(bs, start + 1)[start])
        if expected is None or expected.get(bit, 0.0) <= now:
            return start
        i, hashes = start + 1, prompt.first(bs, min(usable, start + 8))
        while i < usable:
            if i == len(hashes):
                hashes = prompt.first(bs, min(usable, 2 * i))
            if expiries.get(hashes[i], {}).get(bit, 0.0) <= now and not store.holds(bit, hashes[i])[0]:
                break
            i += 1
        return i

    def bits(self, block: int, now: float) -> list[int]:
        """The views the block is expected on until past ``now``."""
        return [bit for bit, expiry in self._expiries.get(block, {}).items() if expiry > now]


class PrefixLookup:
    """The index's read side: how far a prompt's blocks run on each pod asked about (:meth:`lookup`), and which
    pods are worth asking about (:meth:`holders`), from the block indexes, the views and the expected blocks.
    Owns only the block sizes ``holders`` cuts prompts by (read again at most once a second)."""

    def __init__(self, stores: list[BlockIndex], views: EngineViews, expected: ExpectedBlocks,
                 reported_block_size: Callable[[str], int | None]) -> None:
        self._stores, self._views, self._expected = stores, views, expected
        self._reported_block_size = reported_block_size
        self._sizes: dict[BlockIndex, tuple[float, set[int]]] = {}  # per store: when read, the sizes

    def lookup(self, hashes: PromptHashes, pods: Iterable[str]) -> dict[str, PodMatch]:
        self._views.sync()
        out: dict[str, PodMatch | None] = dict.fromkeys(pods)
        groups: dict[tuple[BlockIndex, int], list[EngineView]] = {}  # by store and block size
        by_pod = self._views.by_pod
        for pod in out:
            for view in by_pod.get(pod, ()):
                try:
                    bs = view.store.view_field(view.bit, BLOCK_SIZE) or self._reported_block_size(view.pod)
                except KeyError:  # the view went (a reader: its writer dropped it meanwhile)
                    continue
                if bs:
                    groups.setdefault((view.store, bs), []).append(view)
        now = time.monotonic()
        expected = self._expected if self._expected else None
        for (store, bs), views in groups.items():
            # The engine always recomputes the last prompt token: it never counts as a hit.
            usable = hashes.usable(bs)
            offloaded = store.offload_held() > 0
            for view, confirmed in zip(views, leading_runs(store, [v.bit for v in views], hashes, bs, usable),
                                       strict=True):
                bit, gpu, any_tier = view.bit, confirmed, confirmed
                if confirmed < usable:
                    if expected is not None:
                        gpu = expected.run(store, bit, hashes, bs, usable, confirmed, now)
                    if offloaded:
                        any_tier = walk(store, bit, hashes, bs, usable, confirmed, any_tier=True)
                try:
                    approximate = store.view_field(bit, APPROXIMATE)
                except KeyError:
                    approximate = False
                best = out[view.pod]
                if best is None or gpu * bs > best.gpu_tokens:
                    out[view.pod] = PodMatch(gpu * bs, max(0, any_tier - gpu) * bs, (gpu - confirmed) * bs,
                                             approximate)
        return {pod: match or PodMatch() for pod, match in out.items()}

    def holders(self, prompt: PromptHashes, limit: int) -> list[str]:
        self._views.sync()
        names: dict[str, None] = {}
        now = time.monotonic()
        for store in self._stores:
            by_bit = self._views.pod_of_bit.get(store, {})
            for bs in self._block_sizes(store, by_bit, now):
                usable = prompt.usable(bs)
                deepest = walk(store, -1, prompt, bs, usable, closed=True)
                hashes = prompt.first(bs, min(usable, deepest + 1))
                if deepest < len(hashes) and self._expected:  # pods just routed the block, not confirmed yet
                    for bit in self._expected.bits(hashes[deepest], now):
                        if (pod := by_bit.get(bit)) is not None:
                            names[pod] = None
                # From the deepest held block back to the first, halving: pods with shorter runs too.
                at = deepest
                while at > 0 and len(names) < limit:
                    for bit in store.holders(hashes[at - 1])[1]:
                        if (pod := by_bit.get(bit)) is not None:
                            names[pod] = None
                    at //= 2
        return list(names)[:limit]

    def reaches_end(self, prompt: PromptHashes) -> bool:
        """Whether any pod holds, or is expected to hold, the last block of ``prompt`` a lookup counts, at any
        block size the pods cut prompts by. If none does, no pod's run of the prompt reaches that block, and no
        token after the prompt can add to any pod's match. Undecided (True) where offloaded copies are
        indexed: a run on the offload tier is walked past the GPU's."""
        self._views.sync()
        now = time.monotonic()
        for store in self._stores:
            if store.offload_held():
                return True
            for bs in self._block_sizes(store, self._views.pod_of_bit.get(store, {}), now):
                usable = prompt.usable(bs)
                if usable < 1:
                    return True
                last = prompt.first(bs, usable)[usable - 1]
                if store.holders(last)[0] or (self._expected and self._expected.bits(last, now)):
                    return True
        return False

    def _block_sizes(self, store: BlockIndex, bits: dict[int, str], now: float) -> set[int]:
        """The block sizes of the store's views (as their events say, else their engines' metrics), read again
        at most once a second once one is known (a view learns its own from its first event)."""
        read_at, sizes = self._sizes.get(store, (-1.0, set()))
        if now - read_at >= 1.0 or not sizes:
            sizes = set()
            for bit, pod in bits.items():
                with contextlib.suppress(KeyError):
                    if bs := store.view_field(bit, BLOCK_SIZE) or self._reported_block_size(pod):
                        sizes.add(bs)
            self._sizes[store] = (now, sizes)
        return sizes


class PrefixIndex:
    def __init__(self, max_blocks_per_view: int = 2_000_000, speculative_ttl_s: float = 2.0,
                 publish: Publish = unshared, reported_block_size: Callable[[str], int | None] = lambda pod: None,
                 evictions: EvictionListener | None = None, stores: list[BlockIndex] | None = None,
                 max_views: int = 4096) -> None:
        """``stores``: the block indexes to use: one this process writes, or readers of the host's (one per
        process applying a share of the pods' events); none: one of this process's own."""
        # Told of each block a pod's GPU tier no longer holds, and of each pod whose cache is gone.
        self._evictions = evictions
        self.speculative_ttl_s = speculative_ttl_s
        # A pod's block size as its engine's metrics report it: what a view uses until its events say it,
        # so that a fresh pod's first requests are matched and counted as routed before its first event.
        self._reported_block_size = reported_block_size
        self._stores = stores or [BlockIndex(max_views=max_views, max_blocks_per_view=max_blocks_per_view)]
        self._store = self._stores[0]  # the one written (a writer has only it)
        self.writes = self._store.writer
        # A reader: where each store's eviction notes were read to (none: not followed).
        self._note_cursors: list[int | None] = [None] * len(self._stores)
        self.notes_lost = 0
        self._views = EngineViews(self._stores, self.writes)
        self._speculative = ExpectedBlocks()
        self._lookup = PrefixLookup(self._stores, self._views, self._speculative, reported_block_size)
        self._publish = publish

    @property
    def max_blocks_per_view(self) -> int:
        return self._store.max_blocks_per_view

    @max_blocks_per_view.setter
    def max_blocks_per_view(self, value: int) -> None:
        self._store.max_blocks_per_view = value

    @property
    def stats(self) -> IndexStats:
        return IndexStats(*(sum(column) for column in zip(*(s.stats() for s in self._stores), strict=True)))

    # Views

    def view(self, pod: str, rank: int, model: str, block_size: int | None = None) -> EngineView:
        view = self._views.by_key.get((pod, rank))
        if view is None:
            bit = self._store.add_view(pod, rank, model, namespace_root(model), block_size or 0)
            view = self._views.add(EngineView(self._store, bit, pod, rank, model))
        return view

    def views(self) -> list[EngineView]:
        self._views.sync()
        return list(self._views.by_key.values())

    def reset_view(self, view: EngineView) -> None:
        """Forget every block of the view (engine restarted, or all its blocks were cleared)."""
        # Only the blocks its events had stored are gone: the stream is ordered, and a block stored after the
        # clear (a request that ended before the gateway read the clear, say from the pod's replay buffer at
        # start-up) comes in a later event.
        gone = self._store.reset_view(view.bit, self._evictions is not None)
        if self._evictions is not None:
            self._evictions.cleared(view.pod, gone)

    def mark_approximate(self, view: EngineView) -> None:
        """Events of the view were lost for good: trust it less until :meth:`reset_view`."""
        view.approximate = True

    @staticmethod
    def record_sequence(view: EngineView, seq: int) -> None:
        """The view's subscriber applied (or, with -1, restarted before) event batch ``seq``."""
        view.last_seq = seq

    def drop_pod(self, pod: str) -> None:
        self._views.drop(pod)
        if self._evictions is not None:
            self._evictions.dropped(pod)

    def follow_notes(self) -> int:
        """A reader tells its eviction listener what the writers' rings say the pods evicted since it last
        looked (nothing the first time: from then on); the blocks noted."""
        if self.writes or self._evictions is None:
            return 0
        self._views.sync()
        noted = 0
        for i, store in enumerate(self._stores):
            self._note_cursors[i], lost, groups = store.drain(self._note_cursors[i])
            self.notes_lost += lost
            for bit, kind, blocks in groups:
                if (pod := self._views.pod_of_bit.get(store, {}).get(bit)) is not None:
                    (self._evictions.evicted if kind == "evicted" else self._evictions.cleared)(pod, blocks)
                    noted += len(blocks)
        return noted

    # Events (the subscribers' side)

    def apply_payload(self, view: EngineView, payload: bytes) -> int:
        """Apply one batch as it came over the wire; the events it skipped (unreadable). Decoded natively in
        the common case, else by :func:`~gateway.kv.events.decode_batch` (raises ``BadEventBatch``)."""
        notes = self._store.apply(view.bit, payload, self._evictions is not None)
        if notes is False:
            batch = decode_batch(payload)
            self.apply(view, batch.events)
            return batch.skipped
        if self._evictions is not None:
            for kind, blocks in notes:
                (self._evictions.evicted if kind == "evicted" else self._evictions.cleared)(view.pod, blocks)
        return 0

    def apply(self, view: EngineView, events: Iterable[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store_event(view, event)
            elif isinstance(event, BlockRemoved):
                evicted = self._store.remove(view.bit, list(event.block_hashes), event.medium not in _GPU_MEDIA)
                if evicted and self._evictions is not None:
                    self._evictions.evicted(view.pod, evicted)
            elif isinstance(event, AllBlocksCleared):
                self._store.count("clears")
                self.reset_view(view)

    def _store_event(self, view: EngineView, event: BlockStored) -> None:
        bs, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
        if event.lookahead_token_ids or bs <= 0 or len(tokens) != len(hashes) * bs:
            self._store.count("rejected")
            return
        if view.block_size != bs:
            if view.block_size is not None:
                log.warning("pod %s rank %d: block size %s → %d", view.pod, view.rank, view.block_size, bs)
            view.block_size = bs
        parent: int | None  # the own hash of the block before (None: the first block of a prompt)
        if event.parent_block_hash is None:
            parent, chained = None, namespace_root(view.model, event.lora_name)
        else:
            parent = self._store.own_of(view.bit, event.parent_block_hash)
            if parent is None:
                self._store.count("unknown_parent")
                return
            chained = parent
        extras = extra_key_bytes(event.extra_keys, event.lora_name)
        try:
            owns = prefix_hashes(chained, tokens, bs, extras)
        except (OverflowError, TypeError):  # a token id that is no uint32
            self._store.count("rejected")
            return
        self._store.store(view.bit, parent, list(hashes), owns, event.medium not in _GPU_MEDIA, bs)

    # Lookup (routing's side)

    def prompt_hashes(self, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes) -> PromptHashes:
        if isinstance(token_ids, PromptHashes):
            return token_ids
        return PromptHashes(namespace_root(model, lora_name), token_ids)

    def lookup(self, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes,
               pods: Iterable[str]) -> dict[str, PodMatch]:
        """Per pod, the longest run of the prompt's blocks cached from the first block. Costs the pods asked
        about (their runs found together, a native call per pass), not the pods indexed."""
        return self._lookup.lookup(self.prompt_hashes(model, lora_name, token_ids), pods)

    def holders(self, prompt: PromptHashes, limit: int) -> list[str]:
        """Up to ``limit`` pods holding the longest runs of the prompt's blocks, longest first: the pods whose
        match is worth looking at, found without looking at every pod. Each pod's exact match is
        :meth:`lookup`'s; this only names candidates (a few holders per block, from the deepest held)."""
        return self._lookup.holders(prompt, limit)

    def reaches_end(self, prompt: PromptHashes) -> bool:
        """Whether a pod may hold ``prompt`` to its end (:meth:`PrefixLookup.reaches_end`): if not, what
        follows it cannot change any pod's match."""
        return self._lookup.reaches_end(prompt)

    # Speculative insertion (the routed-prefix step's side)

    def expect(self, pod: str, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes,
               confirmed_tokens: int = 0) -> None:
        """Speculative insertion: the prompt's blocks will soon be on ``pod`` (rank 0's view). The first
        ``confirmed_tokens``' worth the pod's events already confirmed: only the rest are expected, here
        and by the other processes (they get the same events)."""
        now = time.monotonic()
        self._speculative.sweep(now)
        view = self._views.rank0(pod)
        if view is None or not (bs := self._block_size_of(view)) or self.speculative_ttl_s <= 0:
            return
        prompt = self.prompt_hashes(model, lora_name, token_ids)
        new = prompt.first(bs, prompt.token_count)[confirmed_tokens // bs:]
        if new:
            self._speculative.add(view.bit, new, now + self.speculative_ttl_s)
            self._publish(BlocksExpected(pod, new))

    def apply_remote(self, origin: str, fact: BlocksExpected) -> None:
        """Another worker or replica just routed these blocks to the pod."""
        now = time.monotonic()
        self._speculative.sweep(now)
        view = self._views.rank0(fact.pod)
        if view is not None and self.speculative_ttl_s > 0:
            self._speculative.add(view.bit, fact.hashes, now + self.speculative_ttl_s)

    # Introspection

    def own_hashes(self, pod: str, rank: int = 0) -> set[int]:
        view = self._views.by_key.get((pod, rank))
        return view.store.own_hashes(view.bit) if view else set()

    def gpu_blocks(self, pod: str) -> int:
        """Distinct blocks the pod's GPU tier holds, over its ranks."""
        return sum(v.gpu_blocks for v in self._views.of(pod))

    def block_size(self, pod: str) -> int | None:
        """The block size of the pod's engine (rank 0): as its events say it, else as its config or its
        engine's metrics do; none while nothing has."""
        view = self._views.rank0(pod)
        return self._block_size_of(view) if view else None

    def _block_size_of(self, view: EngineView) -> int | None:
        return view.block_size or self._reported_block_size(view.pod)

    def blocks_on(self, pod: str) -> int:
        """Blocks the index holds for ``pod`` (all ranks)."""
        return sum(v.blocks for v in self._views.of(pod))

    def size(self) -> int:
        return sum(s.size() for s in self._stores)

    def memory(self) -> dict[str, Any]:
        """Bytes of the block indexes' tables (shared with the host's other processes, when they read them) and
        of their writers' own maps (this process's, when it writes), the entries in them, and per index its
        generation (how often its tables were rebuilt larger) and its writer's pid."""
        out: dict[str, Any] = {}
        for store in self._stores:
            for key, value in store.memory().items():
                if key in ("generation", "writer_pid"):
                    out.setdefault(f"{key}s", []).append(value)
                else:
                    out[key] = out.get(key, 0) + value
        return out

