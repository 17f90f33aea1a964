"""Behaviour every CPUOffloadingManager policy shares (seed chapter 4).

Block pool allocation, reference counts, store/load errors, protection
during eviction and the event stream, checked with exact block ids on
hand-worked scenarios; each test runs under every built-in policy.
Scenarios are chosen so all policies evict the same block: keys are used
once at most (every key sits in ARC's T1 with target 0, SLRU's and
``chain``'s probation, S3-FIFO's small queue, SIEVE's unvisited blocks), so
every policy falls back to evicting the oldest first.
"""

from __future__ import annotations

import pytest

from aiokvo.errors import (
    AiokvoError,
    BlockNotReadyError,
    ConfigError,
    UnknownKeyError,
    UnknownPolicyError,
)
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies import BUILTIN_POLICIES
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, OffloadingEvent, ReqContext

CTX = ReqContext()

pytestmark = pytest.mark.parametrize("policy", sorted(BUILTIN_POLICIES))


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


a, b, c, d, e, f, g, x = (k(n) for n in "abcdefgx")


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def store(m: CPUOffloadingManager, keys: list[OffloadKey]) -> list[int]:
    """Store ``keys`` (all new, room available) and complete them; return their ids."""
    out = m.prepare_store(keys, CTX)
    assert out is not None
    assert out.keys_to_store == keys
    assert out.evicted_keys == []
    m.complete_store(keys)
    return ids(out.store_spec)


def stored(keys: list[OffloadKey]) -> OffloadingEvent:
    return OffloadingEvent(keys=keys, medium="CPU", removed=False)


def removed(keys: list[OffloadKey]) -> OffloadingEvent:
    return OffloadingEvent(keys=keys, medium="CPU", removed=True)


# -- construction --------------------------------------------------------------


def test_negative_num_blocks_is_a_config_error(policy: str) -> None:
    with pytest.raises(ConfigError, match="-3"):
        CPUOffloadingManager(-3, cache_policy=policy)


def test_unknown_policy_name_is_named_in_the_error(policy: str) -> None:
    with pytest.raises(UnknownPolicyError, match=f"{policy}-nope"):
        CPUOffloadingManager(4, cache_policy=f"{policy}-nope")


def test_zero_blocks_stores_nothing(policy: str) -> None:
    m = CPUOffloadingManager(0, cache_policy=policy)
    assert m.prepare_store([a], CTX) is None
    empty = m.prepare_store([], CTX)
    assert empty is not None
    assert (empty.keys_to_store, ids(empty.store_spec), empty.evicted_keys) == ([], [], [])
    assert m.lookup(a, CTX) is False


# -- block pool ----------------------------------------------------------------


def test_fresh_ids_are_handed_out_in_increasing_order(policy: str) -> None:
    m = CPUOffloadingManager(5, cache_policy=policy)
    assert store(m, [a, b, c]) == [0, 1, 2]
    assert store(m, [d]) == [3]
    assert store(m, [e]) == [4]


def test_fresh_ids_come_before_freed_ids_which_are_reused_last_freed_first(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    out = m.prepare_store([a, b, c], CTX)
    assert out is not None and ids(out.store_spec) == [0, 1, 2]
    m.complete_store([a, b, c], success=False)  # free list is now [0, 1, 2]
    assert store(m, [d]) == [3]  # the never-used id 3 goes first
    assert store(m, [e, f]) == [2, 1]  # then the free list, newest first
    assert store(m, [g]) == [0]


def test_one_call_takes_fresh_ids_then_freed_ids(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    out = m.prepare_store([a, b], CTX)
    assert out is not None and ids(out.store_spec) == [0, 1]
    m.complete_store([a, b], success=False)  # free list [0, 1]
    assert store(m, [c, d, e]) == [2, 3, 1]


def test_evicted_ids_are_reused_last_evicted_first(policy: str) -> None:
    m = CPUOffloadingManager(3, cache_policy=policy)
    assert store(m, [a, b, c]) == [0, 1, 2]
    out = m.prepare_store([d, e], CTX)
    assert out is not None
    assert out.evicted_keys == [a, b]
    assert out.keys_to_store == [d, e]
    assert ids(out.store_spec) == [1, 0]


def test_evicts_only_the_shortfall_and_uses_fresh_ids_first(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    assert store(m, [a, b, c]) == [0, 1, 2]
    out = m.prepare_store([d, e], CTX)  # one free block, so one eviction
    assert out is not None
    assert out.evicted_keys == [a]
    assert ids(out.store_spec) == [3, 0]
    assert [m.lookup(key, CTX) for key in (a, b, c, d, e)] == [False, True, True, None, None]


# -- prepare_store filtering ---------------------------------------------------


def test_prepare_store_skips_ready_and_in_flight_keys(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    assert store(m, [a]) == [0]
    out = m.prepare_store([a, b], CTX)
    assert out is not None
    assert (out.keys_to_store, ids(out.store_spec)) == ([b], [1])
    out = m.prepare_store([b, c, a], CTX)  # b is still being written
    assert out is not None
    assert (out.keys_to_store, ids(out.store_spec), out.evicted_keys) == ([c], [2], [])


def test_prepare_store_keeps_the_first_of_repeated_keys(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    out = m.prepare_store([b, a, b, c, a], CTX)
    assert out is not None
    assert out.keys_to_store == [b, a, c]
    assert ids(out.store_spec) == [0, 1, 2]
    m.complete_store([b, a, c])
    assert store(m, [d]) == [3]  # nothing leaked: exactly one block left


def test_repeated_keys_count_once_against_capacity(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    out = m.prepare_store([a, a, b, b], CTX)
    assert out is not None
    assert (out.keys_to_store, ids(out.store_spec), out.evicted_keys) == ([a, b], [0, 1], [])


def test_prepare_store_of_held_keys_returns_an_empty_output(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    store(m, [a, b])
    m.take_events()
    for keys in ([a, b], [], [b, b]):
        out = m.prepare_store(keys, CTX)
        assert out is not None
        assert (out.keys_to_store, ids(out.store_spec), out.evicted_keys) == ([], [], [])
    assert list(m.take_events()) == []


def test_more_new_keys_than_blocks_returns_none_and_changes_nothing(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    assert m.prepare_store([a, b, c], CTX) is None
    assert [m.lookup(key, CTX) for key in (a, b, c)] == [False, False, False]
    assert list(m.take_events()) == []
    assert store(m, [a, b]) == [0, 1]


# -- lookup --------------------------------------------------------------------


def test_lookup_has_three_answers(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    assert m.lookup(a, CTX) is False
    assert m.prepare_store([a], CTX) is not None
    assert m.lookup(a, CTX) is None
    m.complete_store([a])
    assert m.lookup(a, CTX) is True
    m.prepare_load([a], CTX)
    assert m.lookup(a, CTX) is True  # being read is still readable


def test_lookup_prefix_counts_leading_ready_keys(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    store(m, [a, b])
    assert m.prepare_store([c], CTX) is not None  # c in flight
    assert m.lookup_prefix([a, b, x], CTX) == 2
    assert m.lookup_prefix([a, b], CTX) == 2
    assert m.lookup_prefix([x, a, b], CTX) == 0
    assert m.lookup_prefix([], CTX) == 0
    assert m.lookup_prefix([a, c, b], CTX) is None  # the first miss is in flight
    assert m.lookup_prefix([c], CTX) is None
    assert m.lookup_prefix([a, x, c], CTX) == 1  # the first miss is absent
    m.complete_store([c])
    assert m.lookup_prefix([a, c, b, x], CTX) == 3


# -- complete_store ------------------------------------------------------------


def test_complete_store_success_makes_writing_keys_ready_in_one_event(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    assert m.prepare_store([a, b, c], CTX) is not None
    m.complete_store([c, x, a])  # unknown keys are ignored
    assert list(m.take_events()) == [stored([c, a])]
    assert [m.lookup(key, CTX) for key in (a, b, c)] == [True, None, True]
    m.complete_store([a, b, c])  # a and c are already ready
    assert list(m.take_events()) == [stored([b])]
    m.complete_store([a, b])
    assert list(m.take_events()) == []


def test_complete_store_failure_frees_writing_blocks_without_an_event(policy: str) -> None:
    m = CPUOffloadingManager(3, cache_policy=policy, enable_events=True)
    store(m, [a])
    m.take_events()
    assert m.prepare_store([b, c], CTX) is not None
    m.complete_store([c, b, x], success=False)
    assert [m.lookup(key, CTX) for key in (a, b, c)] == [True, False, False]
    assert list(m.take_events()) == []
    assert store(m, [d, e]) == [1, 2]  # freed c (id 2) then b (id 1): b's id pops first


def test_failed_complete_store_leaves_ready_keys_alone(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    assert store(m, [a, b]) == [0, 1]
    m.prepare_load([a], CTX)
    m.complete_store([a, b], success=False)
    assert m.lookup(a, CTX) is True and m.lookup(b, CTX) is True
    assert ids(m.prepare_load([b, a], CTX)) == [1, 0]


# -- loads and reference counts -------------------------------------------------


def test_prepare_load_returns_block_ids_in_key_order(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    store(m, [a, b, c])
    assert ids(m.prepare_load([c, a], CTX)) == [2, 0]
    assert ids(m.prepare_load([b, b], CTX)) == [1, 1]
    assert ids(m.prepare_load([], CTX)) == []


def test_prepare_load_of_absent_key_raises_and_pins_nothing(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    store(m, [a, b])
    with pytest.raises(UnknownKeyError):
        m.prepare_load([a, x], CTX)
    out = m.prepare_store([c], CTX)  # a would be protected if the failed call had pinned it
    assert out is not None and out.evicted_keys == [a]


def test_prepare_load_of_writing_key_raises_and_pins_nothing(policy: str) -> None:
    m = CPUOffloadingManager(3, cache_policy=policy)
    store(m, [a, b])
    assert m.prepare_store([c], CTX) is not None
    with pytest.raises(BlockNotReadyError):
        m.prepare_load([a, c], CTX)
    assert m.lookup(c, CTX) is None
    out = m.prepare_store([d], CTX)
    assert out is not None and out.evicted_keys == [a]


def test_unknown_key_error_is_also_a_key_error(policy: str) -> None:
    m = CPUOffloadingManager(1, cache_policy=policy)
    with pytest.raises(KeyError):
        m.prepare_load([x], CTX)


def test_a_block_being_read_is_never_evicted(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    store(m, [a, b])
    m.prepare_load([a], CTX)
    out = m.prepare_store([c], CTX)
    assert out is not None
    assert (out.evicted_keys, ids(out.store_spec)) == ([b], [1])
    assert m.prepare_store([d], CTX) is None  # a is read, c is written
    m.complete_load([a])
    out = m.prepare_store([d], CTX)
    assert out is not None
    assert (out.evicted_keys, ids(out.store_spec)) == ([a], [0])


def test_each_load_holds_its_own_reference(policy: str) -> None:
    m = CPUOffloadingManager(1, cache_policy=policy)
    store(m, [a])
    m.prepare_load([a], CTX)
    m.prepare_load([a, a], CTX)
    for _ in range(3):
        assert m.prepare_store([b], CTX) is None
        m.complete_load([a])
    out = m.prepare_store([b], CTX)
    assert out is not None and out.evicted_keys == [a]


def test_a_block_being_written_is_never_evicted(policy: str) -> None:
    m = CPUOffloadingManager(1, cache_policy=policy)
    assert m.prepare_store([a], CTX) is not None
    assert m.prepare_store([b], CTX) is None
    m.complete_store([a])
    out = m.prepare_store([b], CTX)
    assert out is not None
    assert (out.evicted_keys, ids(out.store_spec)) == ([a], [0])


def test_complete_load_of_unknown_or_unpinned_key_is_an_error(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    store(m, [a])
    with pytest.raises(AiokvoError):
        m.complete_load([x])
    with pytest.raises(AiokvoError):
        m.complete_load([a])


# -- eviction protection and atomicity -----------------------------------------


def test_keys_of_the_call_are_protected(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    store(m, [a, b])
    out = m.prepare_store([a, c], CTX)  # a is held, so it is skipped and protected
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys, ids(out.store_spec)) == ([c], [b], [1])


def test_none_when_nothing_can_be_evicted_and_nothing_changes(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    store(m, [a, b])
    m.take_events()
    m.prepare_load([a, b], CTX)
    assert m.prepare_store([c], CTX) is None
    assert m.prepare_store([b, c], CTX) is None
    assert [m.lookup(key, CTX) for key in (a, b, c)] == [True, True, False]
    assert list(m.take_events()) == []
    m.complete_load([a, b])
    out = m.prepare_store([c], CTX)
    assert out is not None
    assert (out.evicted_keys, ids(out.store_spec)) == ([a], [0])


def test_eviction_is_all_or_nothing(policy: str) -> None:
    m = CPUOffloadingManager(3, cache_policy=policy, enable_events=True)
    store(m, [a, b, c])
    m.take_events()
    m.prepare_load([b, c], CTX)
    assert m.prepare_store([d, e], CTX) is None  # needs two, only a is evictable
    assert m.lookup(a, CTX) is True
    assert list(m.take_events()) == []
    out = m.prepare_store([d], CTX)
    assert out is not None
    assert (out.evicted_keys, ids(out.store_spec)) == ([a], [0])


def test_loads_and_lookups_do_not_refresh_recency(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    store(m, [a, b])
    assert m.lookup(a, CTX) is True
    m.prepare_load([a], CTX)
    m.complete_load([a])
    out = m.prepare_store([c], CTX)
    assert out is not None and out.evicted_keys == [a]


def test_order_is_set_by_prepare_store_not_by_complete_store(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    assert m.prepare_store([a], CTX) is not None
    assert m.prepare_store([b], CTX) is not None
    m.complete_store([b])
    m.complete_store([a])
    out = m.prepare_store([c], CTX)
    assert out is not None and out.evicted_keys == [a]


def test_touching_unknown_keys_is_harmless(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy)
    store(m, [a, b])
    m.touch([x])
    m.touch([])
    out = m.prepare_store([c], CTX)
    assert out is not None and out.evicted_keys == [a]


# -- events ----------------------------------------------------------------------


def test_eviction_event_precedes_the_stored_event(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    store(m, [a, b])
    assert list(m.take_events()) == [stored([a, b])]
    out = m.prepare_store([c, d], CTX)
    assert out is not None and out.evicted_keys == [a, b]
    m.complete_store([d, c])
    assert list(m.take_events()) == [removed([a, b]), stored([d, c])]
    assert list(m.take_events()) == []


def test_no_events_are_recorded_unless_enabled(policy: str) -> None:
    m = CPUOffloadingManager(1, cache_policy=policy)
    store(m, [a])
    assert m.prepare_store([b], CTX) is not None
    assert list(m.take_events()) == []
