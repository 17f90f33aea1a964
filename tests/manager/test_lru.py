"""LRU eviction order through the manager (seed 5.2), on hand-worked scenarios.

The policy keeps keys least recently used first: ``prepare_store`` appends,
``touch`` moves keys to the end walking the call's keys backwards (so its
first key ends up the most recent), and eviction takes the first idle,
unprotected keys in that order.
"""

from __future__ import annotations

from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, ReqContext

CTX = ReqContext()


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


a, b, c, d, e, f, g = (k(n) for n in "abcdefg")


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def lru(num_blocks: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_blocks, cache_policy="lru")


def put(m: CPUOffloadingManager, *keys: OffloadKey) -> tuple[list[int], list[OffloadKey]]:
    """prepare_store + complete_store; returns (block ids, evicted keys)."""
    out = m.prepare_store(list(keys), CTX)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return ids(out.store_spec), out.evicted_keys


def test_lru_is_the_default_policy() -> None:
    m = CPUOffloadingManager(3)
    put(m, a, b)
    m.touch([a])  # order b, a
    put(m, c)  # order b, a, c (ARC would evict from T1 = [b, c] first)
    assert put(m, d, e) == ([0, 1], [b, a])


def test_evicts_in_insertion_order_without_touches() -> None:
    m = lru(3)
    assert put(m, a, b, c) == ([0, 1, 2], [])
    assert put(m, d) == ([0], [a])
    assert put(m, e, f) == ([2, 1], [b, c])
    assert put(m, g) == ([0], [d])


def test_touch_puts_the_first_key_last_in_line() -> None:
    m = lru(3)
    put(m, a, b, c)
    m.touch([a, b])  # order is now c, b, a
    assert put(m, d, e, f) == ([0, 1, 2], [c, b, a])


def test_touch_with_one_key_at_a_time_is_most_recent_last() -> None:
    m = lru(3)
    put(m, a, b, c)
    m.touch([a])
    m.touch([b])  # order is now c, a, b
    assert put(m, d) == ([2], [c])
    assert put(m, e) == ([0], [a])


def test_repeated_touch_keys_keep_the_first_occurrence_most_recent() -> None:
    m = lru(3)
    put(m, a, b, c)
    m.touch([a, b, a])  # backwards: a, b, a -> order c, b, a
    assert put(m, d) == ([2], [c])
    assert put(m, e) == ([1], [b])


def test_touch_moves_a_block_that_is_still_being_written() -> None:
    m = lru(3)
    out = m.prepare_store([a], CTX)
    assert out is not None
    put(m, b, c)
    m.touch([a])  # order b, c, a although a is not ready yet
    m.complete_store([a])
    assert put(m, d) == ([1], [b])
    assert put(m, e) == ([2], [c])


def test_eviction_skips_pinned_blocks_but_keeps_their_place() -> None:
    m = lru(3)
    put(m, a, b, c)
    m.prepare_load([a], CTX)
    assert put(m, d, e) == ([2, 1], [b, c])
    m.complete_load([a])
    assert put(m, f) == ([0], [a])  # a is still the least recently used


def test_protected_keys_are_skipped_in_order() -> None:
    m = lru(3)
    put(m, a, b, c)
    out = m.prepare_store([b, d, a, e], CTX)  # needs two: only c is idle and unprotected
    assert out is None
    out = m.prepare_store([a, d], CTX)
    assert out is not None
    assert (out.keys_to_store, ids(out.store_spec), out.evicted_keys) == ([d], [1], [b])


def test_restored_key_goes_to_the_back() -> None:
    m = lru(2)
    put(m, a, b)
    assert put(m, c) == ([0], [a])
    assert put(m, a) == ([1], [b])
    assert put(m, d) == ([0], [c])
