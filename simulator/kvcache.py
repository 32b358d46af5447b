"""A paged KV cache with prefix caching, modelled on vLLM's block pool.

Owner: one :class:`PagedKvCache` per simulated pod, driven only by that pod's engine.

As in vLLM 0.32's ``BlockPool`` (checked event for event against a real pod: ``tests/e2e/test_mock_fidelity.py``):
blocks have a fixed size, and block 0 is the null block, never handed out; a full block is cached under a
chained hash of its tokens (vLLM's own, or a per-process seeded one: :mod:`simulator.block_hashes`);
blocks referenced by a running request are never evicted; a finished request frees its blocks tail first,
those that cache nothing (a partial last block) to the *front* of the free queue, to be reused first, and
cached ones to its back, so that cached blocks are evicted least recently freed first; a prefix hit takes
its blocks out of the queue until its request ends; a cached block is evicted (``BlockRemoved``) only when
its slot is reused; the same hash may be cached twice (vLLM does not deduplicate physical blocks), and
each copy is stored and removed with its own event.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Hash, KvEvent
from gateway.kv.hashing import prefix_hashes
from simulator.block_hashes import BlockHasher, SeededBlockHasher


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Hash | None = None
    token_ids: tuple[int, ...] = ()
    # The gateway's own chained hash of this block's tokens and all before it (for /debug/blocks).
    token_hash: int | None = None


@dataclass(eq=False, slots=True)
class CacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    evictions: int = 0


@dataclass(frozen=True, slots=True)
class LoraKey:
    """The LoRA adapter a request runs with: its blocks are its own (vLLM hashes ``("lora", name, path)``
    into each block, and its events name it)."""

    name: str
    path: str
    adapter_id: int

    @property
    def extra(self) -> tuple[tuple[str, ...], ...]:
        return (("lora", self.name, self.path),)


@dataclass(slots=True)
class SequenceBlocks:
    """The blocks one request holds, and the hashes of its full blocks so far."""

    blocks: list[Block] = field(default_factory=list)
    hashes: list[Hash] = field(default_factory=list)
    token_hashes: list[int] = field(default_factory=list)
    # How many of ``blocks`` are already cached (hashed and announced).
    num_cached: int = 0
    lora: LoraKey | None = None
    token_hash_root: int | None = None  # the gateway's own root for it (None: the cache's)


class PagedKvCache:
    def __init__(self, num_blocks: int, block_size: int, *, hasher: BlockHasher | None = None,
                 medium: str | None = None, token_hash_root: int = 0, null_block: bool = True) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("need at least 2 blocks of at least 1 token")
        self.num_blocks = num_blocks  # as the engine reports it (vLLM's num_gpu_blocks: the null block included)
        self.block_size = block_size
        self.hasher = hasher or SeededBlockHasher()
        self.medium = medium
        self.token_hash_root = token_hash_root
        # vLLM takes the first block out of the pool as its null block (SGLang has none).
        self.usable_blocks = num_blocks - 1 if null_block else num_blocks
        # Blocks are made when first used, so that a pool as large as the model's context costs nothing until
        # it is filled: the ids never used yet are ``range(_next_new, num_blocks)``, in the free queue after the
        # uncached blocks freed to its front and before the cached ones freed to its back (as vLLM's queue,
        # which starts with every block in id order).
        self._blocks: list[Block] = []
        self._next_new = num_blocks - self.usable_blocks
        # Free blocks made so far, the next to be reused first. Cached free blocks stay here until their slot
        # is reused.
        self._free: OrderedDict[int, Block] = OrderedDict()
        self._cached: dict[Hash, dict[int, Block]] = {}
        self.events: list[KvEvent] = []
        self.stats = CacheStats()

    # Hashing

    def chain_hashes(self, token_ids: list[int], parent: Hash | None = None, start: int = 0,
                     lora: LoraKey | None = None) -> list[Hash]:
        """Hashes of the full blocks of ``token_ids[start:]``, chained from ``parent``."""
        bs = self.block_size
        extra = lora.extra if lora is not None else None
        out: list[Hash] = []
        for i in range(start, len(token_ids) - bs + 1, bs):
            parent = self.hasher(parent, token_ids[i : i + bs], extra)
            out.append(parent)
        return out

    # Queries

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._next_new

    def usage(self) -> float:
        return 1.0 - self.num_free / self.usable_blocks

    def cached_prefix(self, hashes: list[Hash]) -> list[Block]:
        """Blocks holding the longest cached run of ``hashes`` from the first."""
        found: list[Block] = []
        for h in hashes:
            copies = self._cached.get(h)
            if not copies:
                break
            found.append(next(iter(copies.values())))
        return found

    def copy_rank(self, block: Block) -> int:
        """0 for the copy of its hash that lookups find (the first cached), 1 and up for later copies."""
        assert block.block_hash is not None
        return list(self._cached[block.block_hash]).index(block.block_id)

    def free_blocks_excluding(self, blocks: list[Block]) -> int:
        """Free blocks left if ``blocks`` were taken out of the free queue (touched by a hit)."""
        return self.num_free - sum(1 for b in blocks if b.ref_count == 0)

    def cached_blocks(self) -> list[Block]:
        return [b for copies in self._cached.values() for b in copies.values()]

    # Mutations

    def touch(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free:
            raise MemoryError(f"need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block = self._next_free()
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def _next_free(self) -> Block:
        """Takes the free block to reuse: the front of the queue (a block caching nothing, else the least
        recently freed cached one)."""
        return self._take_uncached() or self._free.popitem(last=False)[1]

    def _take_uncached(self) -> Block | None:
        """A free block caching nothing, if there is one: one freed to the queue's front, else one never used."""
        front = next(iter(self._free.values()), None)
        if front is not None and front.block_hash is None:
            return self._free.popitem(last=False)[1]
        if self._next_new == self.num_blocks:
            return None
        block = Block(self._next_new)
        self._next_new += 1
        self._blocks.append(block)
        return block

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        copies = self._cached[block.block_hash]
        del copies[block.block_id]
        if not copies:
            del self._cached[block.block_hash]
        self.events.append(BlockRemoved(block_hashes=[block.block_hash], medium=self.medium))
        self.stats.evictions += 1
        block.block_hash = None
        block.token_ids = ()
        block.token_hash = None

    def cache_full_blocks(self, seq: SequenceBlocks, token_ids: list[int], num_tokens: int | None = None) -> None:
        """Hash and announce the sequence's blocks that became full since the last call, counting the first
        ``num_tokens`` of ``token_ids`` (all of them by default)."""
        bs = self.block_size
        num_full = (len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))) // bs
        if num_full <= seq.num_cached:
            return
        parent = seq.hashes[seq.num_cached - 1] if seq.num_cached else None
        start = seq.num_cached * bs
        new_hashes = seq.hashes[seq.num_cached : num_full]
        if len(new_hashes) < num_full - seq.num_cached:
            new_hashes = self.chain_hashes(token_ids[: num_full * bs], parent, start, seq.lora)
            seq.hashes[seq.num_cached :] = new_hashes
        done = len(seq.token_hashes)
        root = self.token_hash_root if seq.token_hash_root is None else seq.token_hash_root
        seq.token_hashes += prefix_hashes(
            seq.token_hashes[-1] if done else root, token_ids[done * bs : num_full * bs], bs
        )
        for offset, h in enumerate(new_hashes):
            block = seq.blocks[seq.num_cached + offset]
            i = start + offset * bs
            block.block_hash = h
            block.token_ids = tuple(token_ids[i : i + bs])
            block.token_hash = seq.token_hashes[seq.num_cached + offset]
            # A second copy of a hash is cached and announced again, as vLLM does.
            self._cached.setdefault(h, {})[block.block_id] = block
        lora = seq.lora
        self.events.append(BlockStored(
            block_hashes=new_hashes, parent_block_hash=parent, token_ids=token_ids[start : num_full * bs],
            block_size=bs, medium=self.medium,
            # As vLLM 0.32 publishes a LoRA request's blocks: its id and name, and per block the untagged
            # extra keys (the name).
            lora_id=lora.adapter_id if lora else None, lora_name=lora.name if lora else None,
            extra_keys=[[lora.name]] * len(new_hashes) if lora else None,
        ))
        seq.num_cached = num_full

    def free(self, seq: SequenceBlocks) -> None:
        """A request ends: its blocks, tail first (the tail of a prefix is evicted before its head), go back
        to the free queue: those caching nothing to its front (vLLM reuses them first, LIFO), cached ones to
        its back (evicted least recently freed first)."""
        uncached: list[Block] = []
        for block in reversed(seq.blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self._free[block.block_id] = block
        for block in reversed(uncached):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)
        seq.blocks = []

    def reset(self, announce: bool = True) -> bool:
        """Drop every cached block; refused (False) while any block is in use, like vLLM."""
        if self.num_free != self.usable_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
            block.token_ids = ()
            block.token_hash = None
        self._cached.clear()
        if announce:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
