"""The prefix index: which token blocks each pod (and DP rank) holds, keyed by the gateway's own hash.

Owner: written only by the KV-event subscribers (through :meth:`PrefixIndex.apply`) and by routing's
speculative insertion; read by routing through :meth:`PrefixIndex.lookup`. Every process subscribes to
the events itself; its speculative blocks go to the other workers and replicas through the sink it is built
with, and theirs come in through :meth:`PrefixIndex.apply_remote`.

Layout, chosen for a small footprint and a lookup that is one dict probe per prompt block:

- each (pod, rank) is an :class:`EngineView` with a bit of its own, its ``engine hash → own hash`` map
  and a reference count per own hash and tier (vLLM stores duplicates; each copy is stored and removed);
- ``_gpu`` and ``_offload`` map an own hash to the bitmask of views holding it in that tier, so a lookup
  ANDs masks block by block and stops when no candidate is left;
- both per-view maps are bounded LRUs (a dict's insertion order, refreshed on use).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.core.facts import BlocksExpected, Publish, unshared
from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Hash, KvEvent
from gateway.kv.hashing import PromptHashes, chain_hash, namespace_root

log = logging.getLogger("gateway.kv.index")

# Reference counts of both tiers packed in one int: GPU in the low bits, offload above.
_TIER_SHIFT = 24
_GPU_ONE = 1
_OFFLOAD_ONE = 1 << _TIER_SHIFT
_GPU_MASK = _OFFLOAD_ONE - 1
_TOKEN_LIMIT = 1 << 32  # token ids are hashed as uint32


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


class PrefixIndex:
    def __init__(self, max_blocks_per_view: int = 2_000_000, speculative_ttl_s: float = 2.0,
                 publish: Publish = unshared) -> None:
        self.max_blocks_per_view = max_blocks_per_view
        self.speculative_ttl_s = speculative_ttl_s
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
        self._drop_refs(view)
        view.engine_to_own.clear()
        view.approximate = False

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
        if (event.lookahead_token_ids or bs <= 0 or len(tokens) != len(hashes) * bs
                or not all(0 <= t < _TOKEN_LIMIT for t in tokens)):
            self.stats.rejected += 1
            return
        if view.block_size != bs:
            if view.block_size is not None:
                log.warning("pod %s rank %d: block size %s → %d", view.pod, view.rank, view.block_size, bs)
            view.block_size = bs
        if event.parent_block_hash is None:
            parent = namespace_root(view.model, event.lora_name)
        else:
            found = view.engine_to_own.get(event.parent_block_hash)
            if found is None:
                self.stats.unknown_parent += 1
                return
            parent = found
        one = _GPU_ONE if event.medium in (None, "GPU", "gpu") else _OFFLOAD_ONE
        tier = self._gpu if one == _GPU_ONE else self._offload
        bit = 1 << view.bit
        extra = event.extra_keys
        refs, e2o = view.refs, view.engine_to_own
        for i, engine_hash in enumerate(hashes):
            key = extra[i] if extra is not None and i < len(extra) else None
            parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs], repr(key).encode() if key else b"")
            e2o.pop(engine_hash, None)  # re-insert: most recently used last
            e2o[engine_hash] = parent
            count = refs.pop(parent, 0)
            refs[parent] = count + one
            if not count & (_GPU_MASK if one == _GPU_ONE else ~_GPU_MASK):
                tier[parent] = tier.get(parent, 0) | bit
        self.stats.blocks_stored += len(hashes)
        if len(refs) > self.max_blocks_per_view or len(e2o) > self.max_blocks_per_view:
            self._shrink(view)

    def _remove(self, view: EngineView, event: BlockRemoved) -> None:
        one = _GPU_ONE if event.medium in (None, "GPU", "gpu") else _OFFLOAD_ONE
        tier = self._gpu if one == _GPU_ONE else self._offload
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
            self.stats.blocks_removed += 1
            view.evictions += 1

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
            del view.refs[own]
            self._clear_bit(self._gpu, own, view.bit)
            self._clear_bit(self._offload, own, view.bit)
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
        by_size: dict[int, list[EngineView]] = {}
        for view in self._views.values():
            if view.pod in wanted and view.block_size:
                by_size.setdefault(view.block_size, []).append(view)
        out: dict[str, PodMatch] = {}
        now = time.monotonic()
        for bs, views in by_size.items():
            # The engine always recomputes the last prompt token: it never counts as a hit.
            usable = (hashes.token_count - 1) // bs
            confirmed = self._runs(hashes, bs, usable, views, self._gpu, None)
            with_spec = self._runs(hashes, bs, usable, views, self._gpu, now) if self._speculative else confirmed
            any_tier = (self._runs(hashes, bs, usable, views, self._gpu, None, self._offload) if self._offload
                        else confirmed)
            for view in views:
                gpu = with_spec[view.bit]
                match = PodMatch(gpu * bs, max(0, any_tier[view.bit] - gpu) * bs,
                                 (gpu - confirmed[view.bit]) * bs, view.approximate)
                best = out.get(view.pod)
                if best is None or match.gpu_tokens > best.gpu_tokens:
                    out[view.pod] = match
        for pod in wanted - out.keys():
            out[pod] = PodMatch()
        return out

    def _runs(self, prompt: PromptHashes, bs: int, usable: int, views: list[EngineView], tier: dict[int, int],
              now: float | None, also: dict[int, int] | None = None) -> dict[int, int]:
        """Length of the run of leading blocks held, per view bit (hashing no further than needed)."""
        mask = 0
        for view in views:
            mask |= 1 << view.bit
        runs: dict[int, int] = {}
        spec = self._speculative if now is not None else None
        hashes: list[int] = []
        i = 0
        while mask and i < usable:
            if i == len(hashes):
                hashes = prompt.first(bs, min(usable, max(8, 2 * i)))
            h = hashes[i]
            held = tier.get(h, 0)
            if also is not None:
                held |= also.get(h, 0)
            if spec is not None and (expected := spec.get(h)):
                for bit, expiry in expected.items():
                    if expiry > now:
                        held |= 1 << bit
            held &= mask
            dropped = mask & ~held
            while dropped:
                low = dropped & -dropped
                runs[low.bit_length() - 1] = i
                dropped ^= low
            mask = held
            i += 1
        while mask:
            low = mask & -mask
            runs[low.bit_length() - 1] = i
            mask ^= low
        return runs

    def expect(self, pod: str, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes,
               confirmed_tokens: int = 0) -> None:
        """Speculative insertion: the prompt's blocks will soon be on ``pod`` (rank 0's view). Of them, the
        first ``confirmed_tokens``' worth the pod's events already confirmed: the other processes are told
        only of the rest (they get the same events)."""
        now = time.monotonic()
        self._expire_speculative(now)
        view = self._views.get((pod, 0))
        if view is None or not view.block_size or self.speculative_ttl_s <= 0:
            return
        prompt = token_ids if isinstance(token_ids, PromptHashes) else self.prompt_hashes(model, lora_name, token_ids)
        hashes = prompt.first(view.block_size, prompt.token_count)
        self._expect(view, hashes, now)
        new = hashes[confirmed_tokens // view.block_size:]
        if new:
            self._publish(BlocksExpected(pod, new))

    def apply_remote(self, origin: str, fact: BlocksExpected) -> None:
        """Another worker or replica just routed these blocks to the pod."""
        now = time.monotonic()
        self._expire_speculative(now)
        view = self._views.get((fact.pod, 0))
        if view is not None and view.block_size and self.speculative_ttl_s > 0:
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

    def block_size(self, pod: str) -> int | None:
        """The block size of the pod's engine (rank 0), once its events have said it."""
        view = self._views.get((pod, 0))
        return view.block_size if view else None

    def blocks_on(self, pod: str) -> int:
        """Blocks the index holds for ``pod`` (all ranks)."""
        return sum(len(v.refs) for v in self._views.values() if v.pod == pod)

    def size(self) -> int:
        return sum(len(v.refs) for v in self._views.values())
