"""The reuse filter (seed chapter 3): only keys looked up often enough are stored.

``lookup`` counts every key it is asked about in a bounded tracker that
forgets the key looked up least recently; ``prepare_store`` passes on only
the keys counted at least ``store_threshold`` times. Everything else goes
straight to the backing manager.
"""

from __future__ import annotations

import pytest

from aiokvo.errors import ConfigError, UnknownKeyError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, OffloadingEvent, ReqContext

CTX = ReqContext()


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


a, b, c, d = (k(n) for n in "abcd")


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def make(
    num_blocks: int = 8,
    store_threshold: int = 2,
    max_tracker_size: int = 64_000,
    policy: str = "lru",
) -> tuple[FilterReusedOffloadingManager, CPUOffloadingManager]:
    backing = CPUOffloadingManager(num_blocks, cache_policy=policy, enable_events=True)
    return FilterReusedOffloadingManager(backing, store_threshold, max_tracker_size), backing


def look(m: FilterReusedOffloadingManager, *keys: OffloadKey) -> None:
    for key in keys:
        m.lookup(key, CTX)


def stored_keys(m: FilterReusedOffloadingManager, *keys: OffloadKey) -> list[OffloadKey]:
    out = m.prepare_store(list(keys), CTX)
    assert out is not None
    return out.keys_to_store


@pytest.mark.parametrize("threshold", [1, 0, -2])
def test_store_threshold_below_two_is_rejected(threshold: int) -> None:
    backing = CPUOffloadingManager(4)
    with pytest.raises(ConfigError, match=str(threshold)):
        FilterReusedOffloadingManager(backing, store_threshold=threshold)
    with pytest.raises(ValueError):
        FilterReusedOffloadingManager(backing, store_threshold=threshold)


@pytest.mark.parametrize("size", [0, -1])
def test_empty_tracker_is_rejected(size: int) -> None:
    with pytest.raises(ConfigError, match=str(size)):
        FilterReusedOffloadingManager(CPUOffloadingManager(4), max_tracker_size=size)


def test_defaults_follow_the_seed() -> None:
    m = FilterReusedOffloadingManager(CPUOffloadingManager(4))
    assert (m.store_threshold, m.max_tracker_size) == (2, 64_000)


def test_a_key_must_be_looked_up_twice_before_it_is_stored() -> None:
    m, backing = make()
    assert stored_keys(m, a) == []
    look(m, a)
    assert stored_keys(m, a) == []
    look(m, a)
    assert stored_keys(m, a) == [a]
    assert backing.lookup(a, CTX) is None


def test_higher_threshold_needs_more_lookups() -> None:
    m, _ = make(store_threshold=3)
    look(m, a, a, b, b, b)
    assert stored_keys(m, a, b) == [b]
    look(m, a)
    assert stored_keys(m, a, b) == [a]  # b is already held, so only a is new


def test_eligible_keys_keep_their_order_and_held_keys_are_skipped() -> None:
    m, _ = make()
    look(m, c, c, a, a, b, b)
    assert stored_keys(m, b, d, a) == [b, a]
    m.complete_store([b, a])
    out = m.prepare_store([a, c, b], CTX)
    assert out is not None
    assert (out.keys_to_store, ids(out.store_spec)) == ([c], [2])


def test_nothing_eligible_gives_an_empty_output_not_none() -> None:
    m, _ = make(num_blocks=0)
    out = m.prepare_store([a, b], CTX)
    assert out is not None
    assert (out.keys_to_store, ids(out.store_spec), out.evicted_keys) == ([], [], [])
    look(m, a, a)
    assert m.prepare_store([a], CTX) is None  # eligible, but the pool has no room


def test_lookup_answers_for_the_backing_manager() -> None:
    m, _ = make()
    assert m.lookup(a, CTX) is False
    assert stored_keys(m, a) == [] and m.lookup(a, CTX) is False
    assert stored_keys(m, a) == [a]
    assert m.lookup(a, CTX) is None
    m.complete_store([a])
    assert m.lookup(a, CTX) is True


def test_only_lookup_counts() -> None:
    m, backing = make()
    look(m, a)
    backing.lookup(a, CTX)  # the backing manager's lookup is not the filter's
    for _ in range(3):
        m.prepare_store([a], CTX)
    m.touch([a])
    assert stored_keys(m, a) == []
    look(m, a)
    assert stored_keys(m, a) == [a]


def test_full_tracker_forgets_the_least_recently_looked_up_key() -> None:
    m, _ = make(max_tracker_size=2)
    look(m, a, b, c)  # a is forgotten: {b: 1, c: 1}
    look(m, a)  # b is forgotten: {c: 1, a: 1}
    look(m, c)  # {a: 1, c: 2}
    assert stored_keys(m, a, b, c) == [c]
    look(m, a)
    assert stored_keys(m, a, b) == [a]


def test_a_repeated_lookup_refreshes_the_key_in_the_tracker() -> None:
    m, _ = make(max_tracker_size=2)
    look(m, a, b, a)  # {b: 1, a: 2}
    look(m, c)  # b is the oldest now: {a: 2, c: 1}
    assert stored_keys(m, a, b, c) == [a]
    look(m, b)  # {c: 1, b: 1}: a is forgotten
    look(m, c)
    assert stored_keys(m, b, c) == [c]


def test_a_forgotten_key_counts_from_one_again() -> None:
    m, _ = make(max_tracker_size=1)
    look(m, a, b, a)
    assert stored_keys(m, a) == []
    look(m, a)
    assert stored_keys(m, a) == [a]


def test_lookup_prefix_counts_each_key_it_looks_at_including_the_miss() -> None:
    m, _ = make()
    look(m, a)
    stored_keys(m, a)  # not yet eligible
    look(m, a)
    assert stored_keys(m, a) == [a]
    m.complete_store([a])
    assert m.lookup_prefix([a, b, c], CTX) == 1  # counts a and b, stops before c
    assert stored_keys(m, b, c) == []
    assert m.lookup_prefix([a, b, c], CTX) == 1
    assert stored_keys(m, b, c) == [b]
    assert m.lookup_prefix([a, b, c], CTX) is None  # b is in flight: counted, c is not
    look(m, c)
    assert stored_keys(m, c) == []


def test_lookup_prefix_counts_every_key_when_all_hit() -> None:
    m, _ = make()
    look(m, a, a, b, b)
    assert stored_keys(m, a, b) == [a, b]
    m.complete_store([a, b])
    assert m.lookup_prefix([a, b, c, c], CTX) == 2  # counts a, b, c; the second c is not reached
    assert stored_keys(m, c) == []
    assert m.lookup_prefix([c, c], CTX) == 0  # counts c once more
    assert stored_keys(m, c) == [c]


def test_other_calls_go_to_the_backing_manager() -> None:
    m, backing = make(num_blocks=2)
    look(m, a, a, b, b, c, c)
    assert stored_keys(m, a, b) == [a, b]
    m.complete_store([a, b])
    assert list(m.take_events()) == [OffloadingEvent([a, b], "CPU", removed=False)]
    assert ids(m.prepare_load([b], CTX)) == [1]
    with pytest.raises(UnknownKeyError):
        m.prepare_load([c], CTX)
    m.touch([a])  # LRU order b, a; b is pinned, a is not
    assert m.prepare_store([c], CTX) is not None and backing.lookup(a, CTX) is False
    m.complete_load([b])
    m.complete_store([c], success=False)
    assert backing.lookup(c, CTX) is False
    assert list(m.take_events()) == [OffloadingEvent([a], "CPU", removed=True)]


async def test_subscribers_see_the_backing_managers_events() -> None:
    m, _ = make()
    look(m, a, a)
    async with m.subscribe(maxsize=4) as events:
        assert stored_keys(m, a) == [a]
        m.complete_store([a])
        assert await events.receive() == OffloadingEvent([a], "CPU", removed=False)
