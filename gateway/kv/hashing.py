"""The gateway's own chained hash of token blocks (spec: ``specs/kv-events.md``, "Why the gateway
hashes tokens itself").

``h_i = xxh3_64(h_{i-1} || tokens_i)``, seeded per namespace (model, LoRA adapter) so blocks of
different adapters never collide. Engine hashes differ per process and version; these do not.
"""

from __future__ import annotations

from array import array

import xxhash


def namespace_root(model: str, lora_name: str | None = None) -> int:
    return xxhash.xxh3_64_intdigest(f"{model}\x00{lora_name or ''}".encode())


def chain_hash(parent: int, block_tokens: list[int] | tuple[int, ...], extra: bytes = b"") -> int:
    data = parent.to_bytes(8, "little") + array("I", block_tokens).tobytes() + extra
    return xxhash.xxh3_64_intdigest(data)


def prefix_hashes(root: int, token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of every full block of ``token_ids``, each chained to the one before."""
    out: list[int] = []
    parent = root
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[i : i + block_size])
        out.append(parent)
    return out
