"""The one LRU the caches share: what is forgotten first, and what is never forgotten."""

from __future__ import annotations

import pytest

from gateway.lru import LruCache


def test_least_recently_used_goes_first_and_reads_do_not_refresh():
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a plain read: "a" stays the oldest
    cache.put("c", 3)
    assert list(cache) == ["b", "c"]
    assert cache.touch("b") == 2 and cache.touch("zz") is None  # a touch refreshes
    cache.put("d", 4)
    assert list(cache) == ["b", "d"]


def test_entries_to_keep_are_skipped_until_they_may_go():
    busy = {"a"}
    cache: LruCache[str, int] = LruCache(1, keep=lambda key, value: key in busy)
    cache.put("a", 1)
    cache.put("b", 2)
    assert list(cache) == ["a"]  # b was evictable, a was not
    busy.clear()
    cache.put("c", 3)
    assert list(cache) == ["c"]


def test_direct_writes_are_bounded_by_trim():
    cache: LruCache[int, int] = LruCache(3)
    for i in range(10):
        cache[i] = i
    cache.trim()
    assert list(cache) == [7, 8, 9]
    with pytest.raises(ValueError, match="at least 1"):
        LruCache(0)
