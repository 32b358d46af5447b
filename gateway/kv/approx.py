"""The approximate prefix index: the gateway's own routing history, for pods without KV events and for
requests that could not be tokenized.

It remembers which pod received which text, in chained blocks of characters, and assumes a pod still
holds what it was sent recently. Owner: routing alone (the prefix matcher records after each decision and
reads before scoring); the pod-removal path forgets a pod.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import xxhash

from gateway.lru import LruCache


class ApproximatePrefixIndex:
    def __init__(self, block_chars: int = 256, max_blocks: int = 500_000, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_chars = block_chars
        self._clock = clock
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        # block hash → {pod: last time that pod was sent this block}.
        self._blocks: LruCache[int, dict[str, float]] = LruCache(max_blocks)

    def _hashes(self, text: str) -> list[int]:
        out, parent, step = [], 0, self.block_chars
        for i in range(0, len(text) - step + 1, step):
            parent = xxhash.xxh3_64_intdigest(text[i : i + step].encode(), seed=parent)
            out.append(parent)
        return out

    def lookup(self, text: str, pods: Iterable[str]) -> dict[str, int]:
        """Per pod, how many leading characters of ``text`` it was sent recently."""
        alive = set(pods)
        matched = dict.fromkeys(alive, 0)
        # Negative on a host up for less than ``ttl_s``: only pods actually sent a block may count.
        oldest = self._clock() - self.ttl_s
        for i, h in enumerate(self._hashes(text)):
            holders = self._blocks.get(h)
            if not holders:
                break
            alive = {p for p in alive if (sent := holders.get(p)) is not None and sent > oldest}
            if not alive:
                break
            for pod in alive:
                matched[pod] = (i + 1) * self.block_chars
        return matched

    def record(self, text: str, pod: str) -> None:
        now = self._clock()
        blocks = self._blocks
        for h in self._hashes(text):
            holders = blocks.pop(h, None) or {}  # re-inserted last: the most recently used
            holders[pod] = now
            blocks[h] = holders
        blocks.trim()

    def forget_pod(self, pod: str) -> None:
        for holders in self._blocks.values():
            holders.pop(pod, None)

    def __len__(self) -> int:
        return len(self._blocks)
