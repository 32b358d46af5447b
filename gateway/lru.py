"""Bounded mappings that forget their least recently used entries: the LRUs the gateway's caches share.
:class:`LruCache` is bounded by its number of entries; :class:`WeightedLru` by the sum of its entries'
weights (prompts, bounded by their tokens: ``tokenization/reuse.py``, ``workflow/refresh.py``).

A ``dict`` keeps insertion order, so an LRU is a dict whose used entries move to the end and whose first
entries go when it is full. :class:`LruCache` is such a dict: its own methods (``get``, ``in``,
iteration) read without refreshing, at C speed, for hot loops; :meth:`LruCache.touch` and
:meth:`LruCache.put` refresh; :meth:`LruCache.trim` applies the bound (``put`` does it itself).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LruCache(dict[K, V]):
    """At most ``capacity`` entries. ``keep`` (optional) marks entries that must not be evicted (e.g. a
    session with a request in flight): they are skipped, so the cache may then hold more than
    ``capacity`` until they become evictable."""

    def __init__(self, capacity: int, keep: Callable[[K, V], bool] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU cache needs a capacity of at least 1, got {capacity}")
        super().__init__()
        self.capacity = capacity
        self._keep = keep

    def touch(self, key: K) -> V | None:
        """The entry, made the most recently used (None if absent)."""
        value = self.pop(key, None)
        if value is not None:
            self[key] = value
        return value

    def put(self, key: K, value: V) -> None:
        self.pop(key, None)
        self[key] = value
        if len(self) > self.capacity:
            self.trim()

    def trim(self) -> None:
        """Forget the least recently used entries (those ``keep`` allows) until within ``capacity``."""
        excess = len(self) - self.capacity
        if excess <= 0:
            return
        victims: list[K] = []
        for key, value in self.items():
            if len(victims) == excess:
                break
            if self._keep is None or not self._keep(key, value):
                victims.append(key)
        for key in victims:
            del self[key]


class WeightedLru(Generic[K, V]):
    """Entries of a weight each (a prompt's tokens), at most ``capacity`` in all: the least recently put or
    touched go first. ``keep_newest``: the entry just put stays even when it alone weighs more than that."""

    def __init__(self, capacity: int, weight: Callable[[V], int], keep_newest: bool = False) -> None:
        self.capacity = capacity
        self.total = 0
        self._weight = weight
        self._floor = 1 if keep_newest else 0
        # Ordered for O(1) eviction from the front (a dict's first live entry is found by a scan past the
        # ones deleted before it).
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The entry, left where it is in the order."""
        return self._entries.get(key)

    def touch(self, key: K) -> V | None:
        """The entry, made the most recently used (None if absent)."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self.pop(key)
        self._entries[key] = value
        self.total += self._weight(value)
        while self.total > self.capacity and len(self._entries) > self._floor:
            self.total -= self._weight(self._entries.popitem(last=False)[1])

    def pop(self, key: K) -> V | None:
        value = self._entries.pop(key, None)
        if value is not None:
            self.total -= self._weight(value)
        return value

    def keys(self) -> list[K]:
        """Least recently used first."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
