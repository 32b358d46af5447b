"""The prefix index: which token blocks each pod (and DP rank) holds, keyed by the gateway's own hash.

Owner: written only by the KV-event subscribers (through :meth:`PrefixIndex.apply`) and by the pipeline's
speculative insertion (the ``RoutedPrefix`` dispatch step, through :meth:`PrefixIndex.expect`); read by
routing through :meth:`PrefixIndex.lookup`. Every process subscribes to the events itself; its speculative
blocks go to the other workers and replicas through the sink it is built with, and theirs come in through
:meth:`PrefixIndex.apply_remote`.

Layout, chosen for a small footprint and a lookup that costs the log of the matched length:

- each (pod, rank) is an :class:`EngineView` with a bit of its own, its ``engine hash → own hash`` map
  and a reference count per own hash and tier (vLLM stores duplicates; each copy is stored and removed);
- ``_gpu`` and ``_offload`` map an own hash to the bitmask of views holding it in that tier;
- both per-view maps are bounded LRUs (a dict's insertion order, refreshed on use).

Engines evict a cached block only after its descendants (vLLM frees a finished request's blocks tail
first and evicts least recently freed first; SGLang evicts radix-tree leaves), so what one holds is closed
under prefixes: if a prompt's block ``i`` is held, so are all before it. A lookup then gallops and
bisects over the prompt's chained hashes for the end of the held run. Whether a view is so closed is
tracked, not assumed: each view counts its *orphans* (held GPU blocks whose parent it does not hold), and
a view with any (lost events, the memory bound) is walked block by block, as every view used to be.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.core.facts import BlocksExpected, Publish, unshared
from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Hash, KvEvent
from gateway.kv.hashing import PromptHashes, namespace_root, prefix_hashes

log = logging.getLogger("gateway.kv.index")

# Reference counts of both tiers packed in one int: GPU in the low bits, offload above.
_TIER_SHIFT = 24
_GPU_ONE = 1
_OFFLOAD_ONE = 1 << _TIER_SHIFT
_GPU_MASK = _OFFLOAD_ONE - 1


@dataclass(slots=True)
class IndexStats:
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    unknown_parent: int = 0
    unknown_removed: int = 0
    rejected: int = 0  # malformed BlockStored (token count mismatch, lookahead tokens)
    evicted_for_memory: int = 0


@dataclass(eq=False, slots=True)
class EngineView:
    """What the gateway knows of one engine process: a pod's DP rank, until it restarts."""

    pod: str
    rank: int
    model: str
    bit: int
    block_size: int | None
    engine_to_own: dict[Hash, int] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)
    # Set when events were lost for good: routing trusts this view less until a clean base returns.
    approximate: bool = False
    last_seq: int = -1
    evictions: int = 0  # BlockRemoved blocks: the engine reused a cached block's slot
    # The GPU tier's shape: each held block's parent (own hashes), held children per block, and how many
    # held blocks lack their parent (0: what the view holds is closed under prefixes).
    parents: dict[int, int] = field(default_factory=dict)
    held_children: dict[int, int] = field(default_factory=dict)
    orphans: int = 0
    gpu_blocks: int = 0  # distinct blocks held in the GPU tier

    @property
    def key(self) -> tuple[str, int]:
        return (self.pod, self.rank)


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


def _extras(event: BlockStored) -> list[bytes] | None:
    """Per block, what else the engine hashed into it besides the tokens, as bytes for the own hash (a block
    with any can never match a prompt the gateway hashes). A LoRA request's blocks lead their keys with the
    adapter's name (vLLM 0.32): that is the namespace the event already names (``lora_name``), not more."""
    keys = event.extra_keys
    if not keys:
        return None
    lora = event.lora_name
    out = []
    for key in keys:
        if key and lora is not None and key[0] == lora:
            key = key[1:]
        out.append(repr(key).encode() if key else b"")
    return out if any(out) else None


class PrefixIndex:
    def __init__(self, max_blocks_per_view: int = 2_000_000, speculative_ttl_s: float = 2.0,
                 publish: Publish = unshared, reported_block_size: Callable[[str], int | None] = lambda pod: None,
                 evictions: EvictionListener | None = None) -> None:
        # Told of each block a pod's GPU tier no longer holds, and of each pod whose cache is gone.
        self._evictions = evictions
        self.max_blocks_per_view = max_blocks_per_view
        self.speculative_ttl_s = speculative_ttl_s
        # A pod's block size as its engine's metrics report it: what a view uses until its events say it,
        # so that a fresh pod's first requests are matched and counted as routed before its first event.
        self._reported_block_size = reported_block_size
        self.stats = IndexStats()
        self._views: dict[tuple[str, int], EngineView] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._gpu: dict[int, int] = {}
        self._offload: dict[int, int] = {}
        # Speculative insertion: own hash → {view bit: expiry}; expiries queued for cleanup.
        self._speculative: dict[int, dict[int, float]] = {}
        self._speculative_queue: deque[tuple[float, int, list[int]]] = deque()
        self._publish = publish

    # Views

    def view(self, pod: str, rank: int, model: str, block_size: int | None = None) -> EngineView:
        view = self._views.get((pod, rank))
        if view is None:
            bit = self._free_bits.pop() if self._free_bits else self._take_bit()
            view = EngineView(pod, rank, model, bit, block_size)
            self._views[(pod, rank)] = view
        return view

    def _take_bit(self) -> int:
        bit = self._next_bit
        self._next_bit += 1
        return bit

    def views(self) -> list[EngineView]:
        return list(self._views.values())

    def reset_view(self, view: EngineView) -> None:
        """Forget every block of the view (engine restarted, or all its blocks were cleared)."""
        # Only the blocks its events had stored are gone: the stream is ordered, and a block stored after the
        # clear (a request that ended before the gateway read the clear, say from the pod's replay buffer at
        # start-up) comes in a later event.
        gone = [own for own, count in view.refs.items() if count & _GPU_MASK] if self._evictions is not None else []
        self._drop_refs(view)
        view.engine_to_own.clear()
        view.approximate = False
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
        for key in [k for k in self._views if k[0] == pod]:
            view = self._views.pop(key)
            self._drop_refs(view)
            self._free_bits.append(view.bit)
        if self._evictions is not None:
            self._evictions.dropped(pod)

    def _drop_refs(self, view: EngineView) -> None:
        clear = ~(1 << view.bit)
        for own in view.refs:
            for tier in (self._gpu, self._offload):
                mask = tier.get(own)
                if mask is not None:
                    mask &= clear
                    if mask:
                        tier[own] = mask
                    else:
                        del tier[own]
        view.refs.clear()
        view.parents.clear()
        view.held_children.clear()
        view.orphans = 0
        view.gpu_blocks = 0

    @staticmethod
    def _gpu_held(view: EngineView, own: int, parent: int | None) -> None:
        """``own`` (child of ``parent``; None: a first block) is now in the view's GPU tier."""
        view.gpu_blocks += 1
        if parent is not None:
            view.parents[own] = parent
            view.held_children[parent] = view.held_children.get(parent, 0) + 1
            if not view.refs.get(parent, 0) & _GPU_MASK:
                view.orphans += 1
        view.orphans -= view.held_children.get(own, 0)  # its children had lost their parent: no longer

    @staticmethod
    def _gpu_released(view: EngineView, own: int) -> None:
        """``own`` is no longer in the view's GPU tier (its refs already say so)."""
        view.gpu_blocks -= 1
        view.orphans += view.held_children.get(own, 0)
        parent = view.parents.pop(own, None)
        if parent is not None:
            left = view.held_children[parent] - 1
            if left:
                view.held_children[parent] = left
            else:
                del view.held_children[parent]
            if not view.refs.get(parent, 0) & _GPU_MASK:
                view.orphans -= 1

    # Events (the subscribers' side)

    def apply(self, view: EngineView, events: Iterable[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(view, event)
            elif isinstance(event, BlockRemoved):
                self._remove(view, event)
            elif isinstance(event, AllBlocksCleared):
                self.stats.clears += 1
                self.reset_view(view)

    def _store(self, view: EngineView, event: BlockStored) -> None:
        bs, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
        if event.lookahead_token_ids or bs <= 0 or len(tokens) != len(hashes) * bs:
            self.stats.rejected += 1
            return
        if view.block_size != bs:
            if view.block_size is not None:
                log.warning("pod %s rank %d: block size %s → %d", view.pod, view.rank, view.block_size, bs)
            view.block_size = bs
        parent: int | None  # the own hash of the block before (None: the first block of a prompt)
        if event.parent_block_hash is None:
            parent, chained = None, namespace_root(view.model, event.lora_name)
        else:
            parent = view.engine_to_own.get(event.parent_block_hash)
            if parent is None:
                self.stats.unknown_parent += 1
                return
            chained = parent
        one = _GPU_ONE if event.medium in (None, "GPU", "gpu") else _OFFLOAD_ONE
        tier = self._gpu if one == _GPU_ONE else self._offload
        bit = 1 << view.bit
        extras = _extras(event)
        try:
            owns = prefix_hashes(chained, tokens, bs, extras)
        except (OverflowError, TypeError):  # a token id that is no uint32
            self.stats.rejected += 1
            return
        refs, e2o = view.refs, view.engine_to_own
        for engine_hash, own in zip(hashes, owns, strict=True):
            e2o.pop(engine_hash, None)  # re-insert: most recently used last
            e2o[engine_hash] = own
            count = refs.pop(own, 0)
            refs[own] = count + one
            if not count & (_GPU_MASK if one == _GPU_ONE else ~_GPU_MASK):
                tier[own] = tier.get(own, 0) | bit
                if one == _GPU_ONE:
                    self._gpu_held(view, own, parent)
            parent = own
        self.stats.blocks_stored += len(hashes)
        if len(refs) > self.max_blocks_per_view or len(e2o) > self.max_blocks_per_view:
            self._shrink(view)

    def _remove(self, view: EngineView, event: BlockRemoved) -> None:
        one = _GPU_ONE if event.medium in (None, "GPU", "gpu") else _OFFLOAD_ONE
        tier = self._gpu if one == _GPU_ONE else self._offload
        evicted: list[int] = []
        for engine_hash in event.block_hashes:
            # Kept in the map: a duplicate copy or a child may still refer to this engine hash.
            own = view.engine_to_own.get(engine_hash)
            count = view.refs.get(own, 0) if own is not None else 0
            if own is None or not count & (_GPU_MASK if one == _GPU_ONE else ~_GPU_MASK):
                self.stats.unknown_removed += 1
                continue
            count -= one
            if count:
                view.refs[own] = count
            else:
                del view.refs[own]
            if not count & (_GPU_MASK if one == _GPU_ONE else ~_GPU_MASK):
                self._clear_bit(tier, own, view.bit)
                if one == _GPU_ONE:
                    self._gpu_released(view, own)
                    evicted.append(own)
            self.stats.blocks_removed += 1
            view.evictions += 1
        if evicted and self._evictions is not None:
            self._evictions.evicted(view.pod, evicted)

    @staticmethod
    def _clear_bit(tier: dict[int, int], own: int, bit: int) -> None:
        mask = tier.get(own, 0) & ~(1 << bit)
        if mask:
            tier[own] = mask
        else:
            tier.pop(own, None)

    def _shrink(self, view: EngineView) -> None:
        """Past the memory bound, forget the least recently stored tenth of the view."""
        excess = len(view.refs) - self.max_blocks_per_view * 9 // 10
        for own in list(view.refs)[: max(excess, 0)]:
            held_on_gpu = view.refs.pop(own) & _GPU_MASK
            self._clear_bit(self._gpu, own, view.bit)
            self._clear_bit(self._offload, own, view.bit)
            if held_on_gpu:
                self._gpu_released(view, own)  # the oldest stored are often prefixes: orphans follow
            self.stats.evicted_for_memory += 1
        excess = len(view.engine_to_own) - self.max_blocks_per_view * 9 // 10
        for engine_hash in list(view.engine_to_own)[: max(excess, 0)]:
            del view.engine_to_own[engine_hash]

    # Lookup (routing's side)

    def prompt_hashes(self, model: str, lora_name: str | None, token_ids: list[int]) -> PromptHashes:
        return PromptHashes(namespace_root(model, lora_name), token_ids)

    def lookup(self, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes,
               pods: Iterable[str]) -> dict[str, PodMatch]:
        """Per pod, the longest run of the prompt's blocks cached from the first block."""
        hashes = token_ids if isinstance(token_ids, PromptHashes) else self.prompt_hashes(model, lora_name, token_ids)
        wanted = set(pods)
        out: dict[str, PodMatch] = {}
        now = time.monotonic()
        for view in self._views.values():
            if view.pod not in wanted or not (bs := self._block_size_of(view)):
                continue
            # The engine always recomputes the last prompt token: it never counts as a hit.
            usable = (hashes.token_count - 1) // bs
            bit = 1 << view.bit
            confirmed = (self._closed_run(hashes, bs, usable, bit) if not view.orphans
                         else self._extend(hashes, bs, usable, 0, bit, self._gpu))
            gpu = self._extend(hashes, bs, usable, confirmed, bit, self._gpu, now) if self._speculative else confirmed
            any_tier = (self._extend(hashes, bs, usable, confirmed, bit, self._gpu, None, self._offload)
                        if self._offload else confirmed)
            match = PodMatch(gpu * bs, max(0, any_tier - gpu) * bs, (gpu - confirmed) * bs, view.approximate)
            best = out.get(view.pod)
            if best is None or match.gpu_tokens > best.gpu_tokens:
                out[view.pod] = match
        for pod in wanted - out.keys():
            out[pod] = PodMatch()
        return out

    def _closed_run(self, prompt: PromptHashes, bs: int, usable: int, bit: int) -> int:
        """The run of leading blocks in the GPU tier of a view closed under prefixes: galloping (0, 1, 3,
        7, ... blocks), then bisecting; the prompt is hashed no further than twice the run."""
        gpu = self._gpu
        low, step = 0, 1  # every block before ``low`` is held
        high = usable
        while low < usable:
            probe = min(low + step - 1, usable - 1)
            if gpu.get(prompt.first(bs, probe + 1)[probe], 0) & bit:
                low, step = probe + 1, step * 2
            else:
                high = probe
                break
        hashes = prompt.first(bs, high)
        # hashing.leading_run, inlined: a call per probe costs a quarter of this, the lookup's hot loop.
        while low < high:
            mid = (low + high) // 2
            if gpu.get(hashes[mid], 0) & bit:
                low = mid + 1
            else:
                high = mid
        return low

    def _extend(self, prompt: PromptHashes, bs: int, usable: int, start: int, bit: int, tier: dict[int, int],
                now: float | None = None, also: dict[int, int] | None = None) -> int:
        """The run from ``start`` on, block by block, held in ``tier`` (or ``also``, or expected on the
        view until past ``now``)."""
        spec = self._speculative if now is not None else None
        i = start
        hashes = prompt.first(bs, min(usable, start + 8))
        while i < usable:
            if i == len(hashes):
                hashes = prompt.first(bs, min(usable, 2 * i))
            h = hashes[i]
            held = tier.get(h, 0) | (also.get(h, 0) if also is not None else 0)
            if not held & bit:
                expected = spec.get(h) if spec is not None else None
                if expected is None or (expiry := expected.get(bit.bit_length() - 1)) is None or expiry <= now:
                    break
            i += 1
        return i

    def expect(self, pod: str, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes,
               confirmed_tokens: int = 0) -> None:
        """Speculative insertion: the prompt's blocks will soon be on ``pod`` (rank 0's view). The first
        ``confirmed_tokens``' worth the pod's events already confirmed: only the rest are expected, here
        and by the other processes (they get the same events)."""
        now = time.monotonic()
        self._expire_speculative(now)
        view = self._views.get((pod, 0))
        if view is None or not (bs := self._block_size_of(view)) or self.speculative_ttl_s <= 0:
            return
        prompt = token_ids if isinstance(token_ids, PromptHashes) else self.prompt_hashes(model, lora_name, token_ids)
        new = prompt.first(bs, prompt.token_count)[confirmed_tokens // bs:]
        if new:
            self._expect(view, new, now)
            self._publish(BlocksExpected(pod, new))

    def apply_remote(self, origin: str, fact: BlocksExpected) -> None:
        """Another worker or replica just routed these blocks to the pod."""
        now = time.monotonic()
        self._expire_speculative(now)
        view = self._views.get((fact.pod, 0))
        if view is not None and self.speculative_ttl_s > 0:
            self._expect(view, fact.hashes, now)

    def _expect(self, view: EngineView, hashes: list[int], now: float) -> None:
        expiry = now + self.speculative_ttl_s
        for h in hashes:
            self._speculative.setdefault(h, {})[view.bit] = expiry
        self._speculative_queue.append((expiry, view.bit, hashes))

    def _expire_speculative(self, now: float) -> None:
        queue = self._speculative_queue
        while queue and queue[0][0] <= now:
            _, bit, hashes = queue.popleft()
            for h in hashes:
                expected = self._speculative.get(h)
                if expected is not None and expected.get(bit, now + 1) <= now:
                    del expected[bit]
                    if not expected:
                        del self._speculative[h]

    # Introspection

    def own_hashes(self, pod: str, rank: int = 0) -> set[int]:
        view = self._views.get((pod, rank))
        return set(view.refs) if view else set()

    def gpu_blocks(self, pod: str) -> int:
        """Distinct blocks the pod's GPU tier holds, over its ranks."""
        return sum(v.gpu_blocks for v in self._views.values() if v.pod == pod)

    def block_size(self, pod: str) -> int | None:
        """The block size of the pod's engine (rank 0): as its events say it, else as its config or its
        engine's metrics do; none while nothing has."""
        view = self._views.get((pod, 0))
        return self._block_size_of(view) if view else None

    def _block_size_of(self, view: EngineView) -> int | None:
        return view.block_size or self._reported_block_size(view.pod)

    def blocks_on(self, pod: str) -> int:
        """Blocks the index holds for ``pod`` (all ranks)."""
        return sum(len(v.refs) for v in self._views.values() if v.pod == pod)

    def size(self) -> int:
        return sum(len(v.refs) for v in self._views.values())
