"""A second prefix index, written to be obviously right rather than fast: the contract suite
(``tests/unit/test_prefix_index.py``) runs on it too, and random event sequences must give it and the
gateway's index the same answers. It is an oracle, never used by the gateway."""

from __future__ import annotations

import struct
import time
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Hash, KvEvent
from gateway.kv.hashing import PromptHashes
from gateway.kv.views import IndexStats, PodMatch

_GPU = ("GPU", "gpu", None)



_M64 = (1 << 64) - 1
_LEN_MUL, _STEP_MUL = 0x668824D764650DCF, 0x8DA04B0DAF2D7E6F


def _mix(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def hash64(data: bytes, seed: int = 0) -> int:
    """The gateway's hash (``hash64`` in gateway/kv/native/blockindex.c), written out word by word."""
    state = _mix(seed ^ ((len(data) + 1) * _LEN_MUL & _M64))
    for (word,) in struct.iter_unpack("<Q", data + bytes(-len(data) % 8)):
        state = ((state ^ word) * _STEP_MUL) & _M64
        state ^= state >> 32
    return _mix(state)


def namespace_root(model: str, lora_name: str | None = None) -> int:
    return hash64(f"{model}\x00{lora_name or ''}".encode())


def chain_hash(parent: int, block_tokens: list[int], extra: bytes = b"") -> int:
    """One block's hash, written out as the index's docstring defines it (the index hashes a run at once)."""
    return hash64(array("I", block_tokens).tobytes() + extra, parent)


@dataclass(eq=False)
class EngineView:
    pod: str
    rank: int
    model: str
    bit: int
    block_size: int | None
    approximate: bool = False
    last_seq: int = -1

    @property
    def key(self) -> tuple[str, int]:
        return (self.pod, self.rank)


class ReferenceIndex:
    def __init__(self, max_blocks_per_view: int = 2_000_000, speculative_ttl_s: float = 2.0) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        self.stats = IndexStats()
        self._views: dict[tuple[str, int], EngineView] = {}
        # Per view: engine hash → own hash, and per tier the copies of each own hash.
        self._own: dict[tuple[str, int], dict[Hash, int]] = {}
        self._held: dict[tuple[str, int], dict[str, Counter[int]]] = {}
        self._expected: dict[tuple[str, int], dict[int, float]] = {}

    def view(self, pod: str, rank: int, model: str, block_size: int | None = None) -> EngineView:
        key = (pod, rank)
        if key not in self._views:
            self._views[key] = EngineView(pod, rank, model, len(self._views), block_size)
            self.reset_view(self._views[key])
        return self._views[key]

    def reset_view(self, view: EngineView) -> None:
        self._own[view.key] = {}
        self._held[view.key] = {"gpu": Counter(), "offload": Counter()}
        view.approximate = False

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
        bs = event.block_size
        if event.lookahead_token_ids or bs <= 0 or len(event.token_ids) != len(event.block_hashes) * bs or \
                not all(0 <= t < 2**32 for t in event.token_ids):
            self.stats.rejected += 1
            return
        view.block_size = bs
        own = self._own[view.key]
        if event.parent_block_hash is None:
            parent = namespace_root(view.model, event.lora_name)
        elif event.parent_block_hash in own:
            parent = own[event.parent_block_hash]
        else:
            self.stats.unknown_parent += 1
            return
        tier = "gpu" if event.medium in _GPU else "offload"
        for i, engine_hash in enumerate(event.block_hashes):
            key = event.extra_keys[i] if event.extra_keys is not None and i < len(event.extra_keys) else None
            if isinstance(key, (list, tuple)) and key and event.lora_name is not None and key[0] == event.lora_name:
                key = key[1:]  # vLLM's own mark of the adapter the event already names
            parent = chain_hash(parent, event.token_ids[i * bs:(i + 1) * bs], repr(key).encode() if key else b"")
            own[engine_hash] = parent
            self._held[view.key][tier][parent] += 1
        self.stats.blocks_stored += len(event.block_hashes)

    def _remove(self, view: EngineView, event: BlockRemoved) -> None:
        held = self._held[view.key]["gpu" if event.medium in _GPU else "offload"]
        for engine_hash in event.block_hashes:
            own = self._own[view.key].get(engine_hash)
            if own is None or not held[own]:
                self.stats.unknown_removed += 1
                continue
            held[own] -= 1
            if not any(tier[own] for tier in self._held[view.key].values()):
                del self._own[view.key][engine_hash]  # no copy left: an event naming it later names no block
            self.stats.blocks_removed += 1

    def prompt_hashes(self, model: str, lora_name: str | None, token_ids: list[int]) -> PromptHashes:
        return PromptHashes(namespace_root(model, lora_name), token_ids)

    def lookup(self, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes,
               pods: Iterable[str]) -> dict[str, PodMatch]:
        prompt = token_ids if isinstance(token_ids, PromptHashes) else self.prompt_hashes(model, lora_name, token_ids)
        now = time.monotonic()
        out = {pod: PodMatch() for pod in pods}
        best: dict[str, PodMatch] = {}
        for view in self._views.values():
            if view.pod not in out or not view.block_size:
                continue
            bs = view.block_size
            blocks = prompt.first(bs, (prompt.token_count - 1) // bs)
            held = self._held[view.key]
            expected = self._expected.get(view.key, {})
            gpu = confirmed = any_tier = 0
            for h in blocks:
                if held["gpu"][h]:
                    confirmed += 1 if confirmed == gpu else 0
                elif (expiry := expected.get(h)) is None or expiry <= now:
                    break
                gpu += 1
            for h in blocks:
                if not (held["gpu"][h] or held["offload"][h]):
                    break
                any_tier += 1
            match = PodMatch(gpu * bs, max(0, any_tier - gpu) * bs, (gpu - confirmed) * bs, view.approximate)
            if view.pod not in best or match.gpu_tokens > best[view.pod].gpu_tokens:  # the best rank
                best[view.pod] = match
        return {**out, **best}

    def expect(self, pod: str, model: str, lora_name: str | None, token_ids: list[int] | PromptHashes,
               confirmed_tokens: int = 0) -> None:
        view = self._views.get((pod, 0))
        if view is None or not view.block_size or self.speculative_ttl_s <= 0:
            return
        prompt = token_ids if isinstance(token_ids, PromptHashes) else self.prompt_hashes(model, lora_name, token_ids)
        expiry = time.monotonic() + self.speculative_ttl_s
        for h in prompt.first(view.block_size, prompt.token_count)[confirmed_tokens // view.block_size:]:
            self._expected.setdefault(view.key, {})[h] = expiry

    def own_hashes(self, pod: str, rank: int = 0) -> set[int]:
        held = self._held.get((pod, rank))
        return {h for tier in held.values() for h, n in tier.items() if n} if held else set()

    def block_size(self, pod: str) -> int | None:
        view = self._views.get((pod, 0))
        return view.block_size if view else None

    def size(self) -> int:
        return sum(len(self.own_hashes(pod, rank)) for pod, rank in self._views)
