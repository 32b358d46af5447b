"""Block hashes as the simulated pod publishes them in its KV events.

``vllm``: vLLM's own (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``): ``hash_fn((parent,
tuple(tokens), extra_keys))`` with ``hash_fn`` one of its ``--prefix-caching-hash-algo`` choices that
pickle their input, the first block's parent ``NONE_HASH = hash_fn(seed)``. The seed is ``PYTHONHASHSEED``
when set, else ``"vllm-none-hash"`` for sha256 (so every process agrees) and random bytes for xxhash (so
processes differ). Events carry the digest as bytes, or its low 64 bits big-endian as an int with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.

``seeded``: a 64-bit hash reseeded per engine process (older vLLM, SGLang): the same tokens hash
differently on every pod and after every restart.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from typing import Literal, Protocol

import xxhash

from gateway.kv.events import Hash

HashAlgo = Literal["sha256", "xxhash"]
_MASK64 = (1 << 64) - 1
_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


# What else goes into a block's hash, as vLLM tags it: a LoRA request's ``("lora", name, path)``.
ExtraKeys = tuple[tuple[str, ...], ...] | None


class BlockHasher(Protocol):
    def __call__(self, parent: Hash | None, tokens: list[int], extra: ExtraKeys = None) -> Hash: ...

    def reseed(self) -> None:
        """What an engine restart does to its hashes."""


class VllmBlockHasher:
    def __init__(self, algo: HashAlgo = "sha256", int_hashes: bool = False) -> None:
        self.algo = algo
        self.int_hashes = int_hashes
        seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            seed = _DEFAULT_NONE_HASH_SEED if algo == "sha256" else os.urandom(32).hex()
        self._none_hash = self._digest(seed)
        # Int hashes only: published hash → digest, to chain from an int parent. It grows with every distinct
        # block hashed (opt-in flag, simulated pods); bytes hashes chain from the parent itself.
        self._digests: dict[Hash, bytes] = {}

    def _digest(self, value: object) -> bytes:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return hashlib.sha256(data).digest() if self.algo == "sha256" else xxhash.xxh3_128_digest(data)

    def __call__(self, parent: Hash | None, tokens: list[int], extra: ExtraKeys = None) -> Hash:
        if parent is None:
            parent_digest = self._none_hash
        else:
            parent_digest = self._digests[parent] if self.int_hashes else parent
        digest = self._digest((parent_digest, tuple(tokens), extra))
        if not self.int_hashes:
            return digest
        published = int.from_bytes(digest, "big") & _MASK64
        self._digests[published] = digest
        return published

    def reseed(self) -> None:
        """A restart: vLLM's sha256 hashes do not change (xxhash's seed does)."""
        if self.algo != "sha256" and "PYTHONHASHSEED" not in os.environ:
            self._none_hash = self._digest(os.urandom(32).hex())


class SeededBlockHasher:
    def __init__(self, signed: bool = False) -> None:
        self.signed = signed
        self.seed = os.urandom(16)

    def __call__(self, parent: Hash | None, tokens: list[int], extra: ExtraKeys = None) -> Hash:
        h = hashlib.sha256(self.seed)
        h.update(b"\x00" * 8 if parent is None else (int(parent) & _MASK64).to_bytes(8, "little"))
        h.update(array("I", tokens).tobytes())
        if extra:
            h.update(repr(extra).encode())
        value = int.from_bytes(h.digest()[-8:], "little")
        return value - (1 << 64) if self.signed and value >= 1 << 63 else value

    def reseed(self) -> None:
        self.seed = os.urandom(16)
