"""The LRUs the caches share: what is forgotten first, and what is never forgotten."""

from __future__ import annotations

import pytest

from gateway.lru import LruCache, WeightedLru


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


def test_a_weighted_lru_forgets_the_least_recently_used_until_its_weights_fit():
    lru: WeightedLru[str, str] = WeightedLru(10, len)
    for key, value in (("a", "xxxx"), ("b", "xxx"), ("c", "xxx")):
        lru.put(key, value)
    assert lru.total == 10 and lru.keys() == ["a", "b", "c"]
    assert lru.get("a") == "xxxx" and lru.keys()[0] == "a"  # a plain read: "a" stays the oldest
    assert lru.touch("a") == "xxxx" and lru.keys() == ["b", "c", "a"]
    lru.put("d", "xx")  # 12: "b", now the oldest, goes
    assert lru.keys() == ["c", "a", "d"] and lru.total == 9
    lru.put("a", "x")  # a put replaces: the old weight is given back
    assert lru.keys() == ["c", "d", "a"] and lru.total == 6
    assert lru.pop("c") == "xxx" and lru.pop("zz") is None and lru.total == 3


@pytest.mark.parametrize("keep_newest", [False, True])
def test_an_entry_heavier_than_the_whole_bound_stays_only_when_the_newest_is_kept(keep_newest: bool):
    lru: WeightedLru[str, str] = WeightedLru(5, len, keep_newest=keep_newest)
    lru.put("a", "xx")
    lru.put("big", "x" * 8)
    assert lru.keys() == (["big"] if keep_newest else []) and lru.total == (8 if keep_newest else 0)
