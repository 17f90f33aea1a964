"""Soft retention: retained blocks are evicted last, never refuse a store, stay within a
budget and end after their ttl, under every eviction policy."""

from __future__ import annotations

import pytest

from aiokvo import ReqContext, make_offload_key
from aiokvo.errors import ConfigError, InvalidKeyError
from aiokvo.keys import OffloadKey
from aiokvo.manager import CPUOffloadingManager
from aiokvo.manager.retention import Retention

CTX = ReqContext()
POLICIES = ["lru", "arc"]


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def filled(policy: str, names: str, *, budget: int = 4) -> tuple[CPUOffloadingManager, Clock]:
    clock = Clock()
    manager = CPUOffloadingManager(len(names), policy)
    manager.set_retention(Retention(budget, clock=clock))
    out = manager.prepare_store([k(n) for n in names], CTX)
    assert out is not None
    manager.complete_store(out.reservation)
    return manager, clock


def cached(manager: CPUOffloadingManager, names: str) -> set[str]:
    return {n for n in names if manager.block_status(k(n)) is not None}


@pytest.mark.parametrize("policy", POLICIES)
def test_unretained_blocks_go_first_even_when_the_retained_are_oldest(policy: str) -> None:
    manager, _ = filled(policy, "abcd")
    retention = manager.retention
    assert retention is not None
    retention.retain([k("a"), k("b")], ttl=60)  # the least recently used two
    out = manager.prepare_store([k("e"), k("f")], CTX)
    assert out is not None and sorted(out.evicted_keys) == [k("c"), k("d")]
    assert cached(manager, "abcdef") == {"a", "b", "e", "f"}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_store_is_never_refused_for_retention(policy: str) -> None:
    manager, _ = filled(policy, "abcd")
    assert manager.retention is not None
    manager.retention.retain([k(n) for n in "abcd"], ttl=60)
    out = manager.prepare_store([k("e")], CTX)
    assert out is not None and len(out.evicted_keys) == 1
    assert manager.retention.statistics().evicted_retained == 1


def test_lower_priority_retained_blocks_go_before_higher() -> None:
    manager, _ = filled("lru", "abcd")
    retention = manager.retention
    assert retention is not None
    retention.retain([k("c")], priority=5, ttl=60)  # c is newer than a and b
    retention.retain([k("a"), k("b"), k("d")], priority=1, ttl=60)
    out = manager.prepare_store([k("e"), k("f"), k("g")], CTX)
    assert out is not None
    assert sorted(out.evicted_keys) == [k("a"), k("b"), k("d")]  # c last, priority 5


def test_retention_ends_after_its_ttl() -> None:
    manager, clock = filled("lru", "abcd")
    retention = manager.retention
    assert retention is not None
    handle = retention.retain([k("a")], ttl=10)
    clock.now += 9.9
    out = manager.prepare_store([k("e")], CTX)
    assert out is not None and out.evicted_keys == [k("b")]  # a still retained
    clock.now += 0.2
    assert not retention.alive(handle) and len(retention) == 0
    out = manager.prepare_store([k("f")], CTX)
    assert out is not None and out.evicted_keys == [k("a")]  # plain LRU again
    assert retention.statistics().expired == 1


def test_the_budget_bounds_retained_keys() -> None:
    clock = Clock()
    retention = Retention(3, clock=clock)
    first = retention.retain([k(n) for n in "abcde"], ttl=60)  # cut to the budget
    assert len(retention) == 3 and k("a") in retention and k("d") not in retention
    high = retention.retain([k("x")], priority=2, ttl=60)  # displaces the lower one
    assert retention.alive(high) and not retention.alive(first)
    # A newcomer of lower priority that does not fit next to a higher one is dropped.
    low = retention.retain([k("y"), k("z"), k("w")], priority=0, ttl=60)
    assert retention.alive(high) and not retention.alive(low)
    assert len(retention) == 1
    stats = retention.statistics()
    assert stats.displaced >= 1 and stats.budget_blocks == 3


def test_release_ends_a_retention_and_keys_shared_by_two_stay_until_both_end() -> None:
    retention = Retention(8, clock=Clock())
    one = retention.retain([k("a"), k("b")], ttl=60)
    two = retention.retain([k("b")], ttl=60)
    assert retention.release(one) and not retention.release(one)
    assert k("a") not in retention and k("b") in retention
    retention.release(two)
    assert len(retention) == 0


def test_bad_retentions_are_refused_before_anything_changes() -> None:
    retention = Retention(8, clock=Clock())
    with pytest.raises(InvalidKeyError):
        retention.retain(k("a"), ttl=1)  # type: ignore[arg-type]  # a bare key
    with pytest.raises(ConfigError, match="ttl"):
        retention.retain([k("a")], ttl=0)
    with pytest.raises(ConfigError, match="priority"):
        retention.retain([k("a")], priority=1.5, ttl=1)  # type: ignore[arg-type]
    assert len(retention) == 0 and retention.statistics().made == 0


def test_without_retention_the_seed_decisions_are_unchanged() -> None:
    plain, _ = filled("arc", "abcd")
    plain.set_retention(None)
    retained, _ = filled("arc", "abcd")  # a retention with nothing retained
    for manager in (plain, retained):
        manager.touch([k("b"), k("c")])
    a = plain.prepare_store([k("e"), k("f")], CTX)
    b = retained.prepare_store([k("e"), k("f")], CTX)
    assert a is not None and b is not None and a.evicted_keys == b.evicted_keys
