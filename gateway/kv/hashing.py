"""The gateway's own chained hash of token blocks.

``h_i = hash64(tokens_i as uint32 bytes [+ extra keys], seed=h_{i-1})``, starting from a root per
namespace (model, LoRA adapter) so blocks of different adapters never collide. Engine hashes differ per
process and version; these do not. Seeding with the parent avoids building a new buffer per block.
``hash64`` is the gateway's own (gateway/kv/native/blockindex.c, which hashes the blocks of KV events with it
too; restated in Python in tests/kv_reference.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

from gateway.kv._blockindex import hash64 as _hash


def namespace_root(model: str, lora_name: str | None = None) -> int:
    return _hash(f"{model}\x00{lora_name or ''}".encode())


def prefix_hashes(root: int, token_ids: Sequence[int], block_size: int,
                  extras: Sequence[bytes] | None = None) -> list[int]:
    """Hashes of every full block of ``token_ids``, each chained to the one before (the first to
    ``root``), block ``i`` with ``extras[i]`` (if any) after its tokens. Raises ``OverflowError`` or
    ``TypeError`` if an id is not a uint32."""
    data = array("I", token_ids).tobytes()  # slicing bytes is cheaper than slicing a memoryview
    step = 4 * block_size
    out: list[int] = []
    parent = root
    for i, offset in enumerate(range(0, len(token_ids) // block_size * step, step)):
        block = data[offset : offset + step]
        parent = _hash(block + extras[i] if extras is not None and i < len(extras) else block, parent)
        out.append(parent)
    return out


def extra_key_bytes(extra_keys: Sequence[Any] | None, lora_name: str | None) -> list[bytes] | None:
    """Per block of a KV event, what else the engine hashed into it besides the tokens, as bytes for the own
    hash (a block with any can never match a prompt the gateway hashes). A LoRA request's blocks lead their
    keys with the adapter's name (vLLM 0.32): that is the namespace the event already names, not more."""
    if not extra_keys:
        return None
    out = []
    for key in extra_keys:
        if isinstance(key, (list, tuple)) and key and lora_name is not None and key[0] == lora_name:
            key = key[1:]
        out.append(repr(key).encode() if key else b"")
    return out if any(out) else None


def leading_run(holds: Callable[[int], bool], end: int) -> int:
    """The first position in ``[0, end)`` where ``holds`` is false (``end`` if none), for a ``holds`` that
    is true on a prefix of them: what chained hashes give, since a block held, shared or equal implies every
    block before it is too. Bisection: ``holds`` is asked about log2(end) positions."""
    low, high = 0, end
    while low < high:
        mid = (low + high) // 2
        if holds(mid):
            low = mid + 1
        else:
            high = mid
    return low


class PromptHashes:
    """A prompt's block hashes, computed lazily per block size and only as far as a lookup needs.

    A prompt that extends an earlier one (the next turn of a conversation) is built on it (``earlier``):
    the blocks of their ``shared_tokens`` leading tokens are taken as they are, so only the new tail is
    ever hashed."""

    __slots__ = ("_by_size", "_tokens", "more_follow", "root", "token_count")

    def __init__(self, root: int, token_ids: Sequence[int], earlier: PromptHashes | None = None,
                 shared_tokens: int = 0, more_follow: bool = False) -> None:
        self.root = root
        self.token_count = len(token_ids)
        # The ids are a prompt's head, its other tokens still to be tokenized: its last token is not the prompt's.
        self.more_follow = more_follow
        self._tokens = token_ids
        self._by_size: dict[int, list[int]] = {}
        if earlier is not None and earlier.root == root:
            for block_size, hashes in earlier._by_size.items():
                kept = min(len(hashes), shared_tokens // block_size, self.token_count // block_size)
                if kept:
                    self._by_size[block_size] = hashes[:kept]

    def first(self, block_size: int, count: int) -> list[int]:
        """At least the first ``count`` hashes (fewer only if the prompt has fewer full blocks)."""
        done = self._by_size.setdefault(block_size, [])
        count = min(count, self.token_count // block_size)
        start = len(done)
        if start < count:
            # Only the tokens of the blocks still to hash are packed: a long prompt's head is never copied.
            tokens = self._tokens[start * block_size : count * block_size]
            data = tokens.tobytes() if isinstance(tokens, array) else array("I", tokens).tobytes()
            step = 4 * block_size
            parent = done[-1] if done else self.root
            for offset in range(0, (count - start) * step, step):
                parent = _hash(data[offset : offset + step], parent)
                done.append(parent)
        return done

    def usable(self, block_size: int) -> int:
        """How many of its blocks a pod's cache can serve: the engine always computes a prompt's last token,
        so a block that ends the prompt is never a hit."""
        return (self.token_count - (0 if self.more_follow else 1)) // block_size

    def full(self, block_size: int) -> list[int]:
        """The hashes of every full block of the prompt."""
        return self.first(block_size, self.token_count // block_size)

    def known(self, block_size: int) -> int:
        """How many hashes of that block size are computed already (no hashing)."""
        hashes = self._by_size.get(block_size)
        return len(hashes) if hashes is not None else 0
