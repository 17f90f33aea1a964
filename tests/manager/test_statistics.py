"""Manager statistics: every counter moves with the call it counts, and the pool
fields describe the pool at the moment of the snapshot."""

from __future__ import annotations

import dataclasses

import pytest

from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager import ManagerStatistics
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import LoadStoreSpec, PrepareStoreOutput, ReqContext

CTX = ReqContext()


def keys(*names: str) -> list[OffloadKey]:
    return [make_offload_key(n.encode(), 0) for n in names]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_cpu_manager_counts_lookups_loads_stores_and_evictions(policy: str) -> None:
    m = CPUOffloadingManager(3, cache_policy=policy)
    a, b, c, d = keys("a", "b", "c", "d")
    assert m.statistics() == ManagerStatistics(num_blocks=3, free_blocks=3)

    out = m.prepare_store([a, b], CTX)
    assert out is not None
    s = m.statistics()
    assert (s.stores, s.blocks_reserved, s.writing_blocks, s.used_blocks) == (1, 2, 2, 2)
    assert m.lookup_prefix([a, b], CTX) is None  # a store in flight
    assert m.lookup(a, CTX) is None
    m.complete_store([a], success=True)
    m.complete_store([b], success=False)
    s = m.statistics()
    assert (s.blocks_stored, s.blocks_store_failed, s.writing_blocks) == (1, 1, 0)
    assert (s.lookups, s.lookup_in_flight, s.used_blocks, s.free_blocks) == (2, 2, 1, 2)

    assert m.lookup_prefix([a, b, c], CTX) == 1  # stops at b: a miss
    assert m.lookup(a, CTX) is True
    assert m.lookup(d, CTX) is False
    m.prepare_load([a], CTX)
    m.prepare_load([a], CTX)
    s = m.statistics()
    assert (s.lookups, s.lookup_hits, s.lookup_misses) == (5, 2, 2)
    assert (s.loads, s.blocks_pinned, s.pinned_blocks) == (2, 2, 1)

    # Fill the pool: a is pinned, so the next stores must evict around it or give up.
    assert m.prepare_store([b, c], CTX) is not None
    m.complete_store([b, c])
    assert m.prepare_store([d, *keys("e", "f")], CTX) is None  # a pinned: only 2 evictable
    out = m.prepare_store([d], CTX)
    assert out is not None and len(out.evicted_keys) == 1
    s = m.statistics()
    assert (s.stores, s.stores_refused, s.blocks_evicted) == (4, 1, 1)
    m.complete_load([a, a])
    assert m.statistics().pinned_blocks == 0


def test_reuse_filter_adds_its_own_counters_to_the_backing_snapshot() -> None:
    backing = CPUOffloadingManager(8)
    m = FilterReusedOffloadingManager(backing, store_threshold=2)
    a, b = keys("a", "b")
    m.lookup(a, CTX)
    m.lookup(a, CTX)
    m.lookup(b, CTX)
    out = m.prepare_store([a, b], CTX)
    assert out is not None and out.keys_to_store == [a]
    s = m.statistics()
    assert (s.reuse_tracked_keys, s.reuse_filtered_blocks) == (2, 1)
    assert (s.lookups, s.blocks_reserved) == (3, 1)
    assert dataclasses.replace(s, reuse_tracked_keys=0, reuse_filtered_blocks=0) == (
        backing.statistics()
    )


def test_statistics_are_frozen_snapshots() -> None:
    m = CPUOffloadingManager(2)
    before = m.statistics()
    assert m.prepare_store(keys("a"), CTX) is not None
    assert before.stores == 0 and m.statistics().stores == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.stores = 5  # type: ignore[misc]


def test_a_manager_without_counters_reports_zeros() -> None:
    class Bare(OffloadingManager):
        def __init__(self) -> None:
            from aiokvo.manager.sink import EventSink

            self._sink = EventSink(record=False)

        def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
            return False

        def prepare_load(self, keys: object, req_context: ReqContext) -> LoadStoreSpec:
            raise NotImplementedError

        def prepare_store(self, keys: object, req_context: ReqContext) -> PrepareStoreOutput | None:
            return None

    assert Bare().statistics() == ManagerStatistics()
