"""White-box tests of the fast manager: exact seed decisions, walk cost, memory.

The black-box contract is tested elsewhere; here the fast manager is
compared step by step with a deliberately naive model of the seed (per-key
loops, per-victim rescans from the front), and its internals are checked
for the properties the speed work relies on.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence

import numpy as np
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
from aiokvo.manager.policies.arc import ARCCachePolicy
from aiokvo.manager.policies.base import BlockStatus, CachePolicy, Evicted
from aiokvo.manager.policies.lru import LRUCachePolicy
from aiokvo.manager.policies.registry import resolve_policy
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import ReqContext

CTX = ReqContext()


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


# -- a naive model of the seed, for differential checks ---------------------------


class NaiveManager:
    """Seed chapters 4-5 written the slow, obvious way (ref counts per block)."""

    def __init__(self, num_blocks: int, policy: str) -> None:
        self.n = num_blocks
        self.allocated = 0
        self.free: list[int] = []
        self.arc = policy == "arc"
        self.t1: OrderedDict[OffloadKey, list[int]] = OrderedDict()  # LRU uses t1 only
        self.t2: OrderedDict[OffloadKey, list[int]] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target = 0.0

    def get(self, k: OffloadKey) -> list[int] | None:  # [block_id, ref_cnt]
        return self.t1.get(k) or self.t2.get(k)

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int | None:
        hits = 0
        for k in keys:
            b = self.get(k)
            if b is None:
                break
            if b[1] < 0:
                return None
            hits += 1
        return hits

    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        for k in keys:
            b = self.get(k)
            if b is None:
                raise UnknownKeyError(k)
            if b[1] < 0:
                raise BlockNotReadyError(k)
        for k in keys:
            self.get(k)[1] += 1  # type: ignore[index]
        return [self.get(k)[0] for k in keys]  # type: ignore[index]

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        for k in keys:
            self.get(k)[1] -= 1  # type: ignore[index]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for k in reversed(list(keys)):
            if not self.arc:
                if k in self.t1:
                    self.t1.move_to_end(k)
            elif k in self.t1:
                b = self.t1.pop(k)
                if b[1] < 0:
                    self.t1[k] = b
                else:
                    self.t2[k] = b
            elif k in self.t2:
                self.t2.move_to_end(k)
            elif k in self.b1:
                self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.n)
                self.b1.move_to_end(k)
            elif k in self.b2:
                self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(k)

    def _evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        picks: list[tuple[OffloadKey, list[int], bool]] = []
        taken: set[OffloadKey] = set()
        virtual_t1 = len(self.t1)
        for _ in range(n):  # one rescan from the front per victim, as the seed does
            pick = None
            if not self.arc or virtual_t1 >= int(self.target):
                for k, b in self.t1.items():
                    if b[1] == 0 and k not in protected and k not in taken:
                        pick = (k, b, True)
                        virtual_t1 -= 1
                        break
            if pick is None and self.arc:
                for k, b in self.t2.items():
                    if b[1] == 0 and k not in protected and k not in taken:
                        pick = (k, b, False)
                        break
            if pick is None:
                return None
            picks.append(pick)
            taken.add(pick[0])
        for k, _, from_t1 in picks:
            if from_t1:
                del self.t1[k]
                if self.arc:
                    self.b1[k] = None
            else:
                del self.t2[k]
                self.b2[k] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.n:
                ghosts.popitem(last=False)
        return [(k, b[0]) for k, b, _ in picks]

    def prepare_store(self, keys: Sequence[OffloadKey]) -> tuple[list, list, list] | None:
        new = [k for k in dict.fromkeys(keys) if self.get(k) is None]
        if not new:
            return [], [], []
        shortfall = len(new) - (len(self.free) + self.n - self.allocated)
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            got = self._evict(shortfall, set(keys))
            if got is None:
                return None
            for k, bid in got:
                self.free.append(bid)
                evicted.append(k)
        ids = []
        for _ in new:
            if self.allocated < self.n:
                ids.append(self.allocated)
                self.allocated += 1
            else:
                ids.append(self.free.pop())
        for k, bid in zip(new, ids, strict=True):
            self.t1[k] = [bid, -1]
            self.b1.pop(k, None)
            self.b2.pop(k, None)
        return new, ids, evicted

    def complete_store(self, keys: Sequence[OffloadKey], success: bool) -> list[OffloadKey]:
        done = []
        for k in keys:
            b = self.get(k)
            if b is None or b[1] >= 0:
                continue
            if success:
                b[1] = 0
                done.append(k)
            else:
                self.t1.pop(k, None) or self.t2.pop(k, None)
                self.free.append(b[0])
        return done

    def order(self) -> list[tuple[OffloadKey, int]]:
        return [(k, b[0]) for k, b in [*self.t1.items(), *self.t2.items()]]


def _drive(seed: int, policy: str, steps: int = 250) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(0, 10)
    fast = CPUOffloadingManager(capacity, policy, enable_events=True)
    slow = NaiveManager(capacity, policy)
    universe = [key(i) for i in range(rng.randint(1, 24))]
    for _ in range(steps):
        keys = [rng.choice(universe) for _ in range(rng.randint(0, 7))]
        op = rng.randrange(6)
        if op == 0:
            assert fast.lookup_prefix(keys, CTX) == slow.lookup_prefix(keys)
            for k in keys[:2]:
                want = slow.lookup_prefix([k])
                assert fast.lookup(k, CTX) is (None if want is None else bool(want))
        elif op == 1:
            got = fast.prepare_store(keys, CTX)
            want = slow.prepare_store(keys)
            if want is None:
                assert got is None
            else:
                assert got is not None
                ids = got.store_spec.block_ids.tolist()
                assert (got.keys_to_store, ids, got.evicted_keys) == want
        elif op == 2:
            success = rng.random() < 0.75
            fast.take_events()
            fast.complete_store(keys, success)
            done = slow.complete_store(keys, success)
            events = list(fast.take_events())
            assert [e.keys for e in events] == ([done] if done and success else [])
        elif op == 3:
            try:
                want_ids = slow.prepare_load(keys)
            except AiokvoError as exc:
                with pytest.raises(type(exc)):
                    fast.prepare_load(keys, CTX)
            else:
                assert fast.prepare_load(keys, CTX).block_ids.tolist() == want_ids
                if rng.random() < 0.6:
                    fast.complete_load(keys)
                    slow.complete_load(keys)
        else:
            fast.touch(keys)
            slow.touch(keys)
        assert list(fast.policy.items()) == slow.order()
        for k in universe:
            status = fast.block_status(k)
            b = slow.get(k)
            assert (status is None) == (b is None)
            if status is not None and b is not None:
                assert (status.block_id, status.ref_cnt) == (b[0], b[1])
        if policy == "arc":
            arc = fast.policy
            assert isinstance(arc, ARCCachePolicy)
            assert list(arc.b1) == list(slow.b1)
            assert list(arc.b2) == list(slow.b2)
            assert arc.target_t1_size == slow.target


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_decisions_match_a_naive_seed_model(policy: str) -> None:
    for seed in range(60):
        _drive(seed, policy)


# -- eviction walk cost ------------------------------------------------------------


class CountingSet(set[OffloadKey]):
    """A set that counts membership tests, to measure how far a walk went."""

    checks = 0

    def __contains__(self, item: object) -> bool:
        CountingSet.checks += 1
        return super().__contains__(item)


def _pinned_front(policy: str, pinned: int, idle: int) -> CPUOffloadingManager:
    manager = CPUOffloadingManager(pinned + idle, policy)
    keys = [key(i) for i in range(pinned + idle)]
    out = manager.prepare_store(keys, CTX)
    assert out is not None
    manager.complete_store(keys)
    manager.prepare_load(keys[:pinned], CTX)  # the oldest blocks are being read
    return manager


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_walks_past_pinned_blocks_once_per_call(policy: str) -> None:
    pinned, victims = 500, 50
    manager = _pinned_front(policy, pinned, idle=victims)
    protected = CountingSet()
    CountingSet.checks = 0
    got = manager.policy.evict(victims, [protected, manager._pinned])
    assert got is not None
    assert got[0] == [key(i) for i in range(pinned, pinned + victims)]
    # The seed's ARC rescans from the front for every victim: ~pinned * victims.
    assert CountingSet.checks <= pinned + victims + 2


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_failed_eviction_changes_nothing(policy: str) -> None:
    manager = _pinned_front(policy, pinned=6, idle=2)
    before = list(manager.policy.items())
    assert manager.prepare_store([key(100 + i) for i in range(3)], CTX) is None
    assert list(manager.policy.items()) == before
    assert manager.num_free_blocks == 0


def test_arc_failed_eviction_keeps_ghosts_and_target() -> None:
    arc = ARCCachePolicy(4)
    arc.insert([key(i) for i in range(4)], [0, 1, 2, 3])
    assert arc.evict(2, []) == ([key(0), key(1)], [0, 1])
    arc.target_t1_size = 1.5
    ghosts = (list(arc.b1), list(arc.b2))
    assert arc.evict(3, [{key(3)}]) is None
    assert (list(arc.b1), list(arc.b2), arc.target_t1_size) == (*ghosts, 1.5)


def test_arc_victims_are_a_t1_run_then_a_t2_run() -> None:
    arc = ARCCachePolicy(10)
    arc.insert([key(i) for i in range(6)], list(range(6)))
    arc.touch([key(0), key(1), key(2)], writing=set())  # promoted to T2
    arc.target_t1_size = 2.0  # T1 has 3 -> it gives 3 - 2 + 1 = 2 victims
    assert arc.evict(4, [{key(4)}]) == ([key(3), key(5), key(2), key(1)], [3, 5, 2, 1])
    assert list(arc.b1) == [key(3), key(5)]
    assert list(arc.b2) == [key(2), key(1)]


# -- memory ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_bytes_per_cached_block_stay_under_128(policy: str) -> None:
    capacity = 10_000
    keys = [key(i) for i in range(capacity)]  # made before tracing: not counted
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        manager = CPUOffloadingManager(capacity, policy)
        for i in range(0, capacity, 64):
            out = manager.prepare_store(keys[i : i + 64], CTX)
            assert out is not None
            manager.complete_store(out.keys_to_store)
        del out
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(manager) == capacity
    assert grown / capacity <= 128


# -- pins, statuses, specs -----------------------------------------------------------


def test_complete_load_of_unpinned_key_raises_and_changes_nothing() -> None:
    manager = CPUOffloadingManager(4)
    keys = [key(0), key(1)]
    manager.prepare_store(keys, CTX)
    manager.complete_store(keys)
    manager.prepare_load([key(0)], CTX)
    with pytest.raises(BlockNotReadyError, match="no pending load"):
        manager.complete_load([key(0), key(1)])
    with pytest.raises(BlockNotReadyError):
        manager.complete_load([key(0), key(0)])  # loaded once, released twice
    with pytest.raises(UnknownKeyError):
        manager.complete_load([key(9)])
    assert manager.block_status(key(0)) == BlockStatus(0, 1)
    manager.complete_load([key(0)])
    assert manager.block_status(key(0)) == BlockStatus(0, 0)


def test_repeated_loads_count_each_pin() -> None:
    manager = CPUOffloadingManager(4)
    manager.prepare_store([key(0)], CTX)
    manager.complete_store([key(0)])
    manager.prepare_load([key(0), key(0)], CTX)
    manager.prepare_load([key(0)], CTX)
    assert manager.block_status(key(0)) == BlockStatus(0, 3)
    manager.complete_load([key(0), key(0)])
    assert manager.block_status(key(0)) == BlockStatus(0, 1)
    manager.complete_load([key(0)])
    assert manager.block_status(key(0)) == BlockStatus(0, 0)
    assert not manager._pinned and not manager._extra_pins


def test_block_status_reports_writing_and_absent() -> None:
    manager = CPUOffloadingManager(2)
    manager.prepare_store([key(0)], CTX)
    status = manager.block_status(key(0))
    assert status == BlockStatus(0, -1)
    assert status is not None and not status.is_ready
    assert manager.block_status(key(1)) is None


def test_specs_hold_int64_ids_and_empty_spec_is_read_only() -> None:
    manager = CPUOffloadingManager(3)
    out = manager.prepare_store([key(0), key(1)], CTX)
    assert out is not None
    assert out.store_spec.block_ids.dtype == np.int64
    assert out.store_spec.block_ids.tolist() == [0, 1]
    again = manager.prepare_store([key(0)], CTX)
    assert again is not None and len(again.store_spec) == 0
    assert not again.store_spec.block_ids.flags.writeable


def test_prepare_store_stores_a_repeated_key_once() -> None:
    manager = CPUOffloadingManager(4)
    out = manager.prepare_store([key(1), key(2), key(1)], CTX)
    assert out is not None
    assert out.keys_to_store == [key(1), key(2)]
    assert manager.num_free_blocks == 2


@pytest.mark.parametrize("bad", [-1, 2.0, "3", True])
def test_bad_num_blocks_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match=repr(bad)):
        CPUOffloadingManager(bad)  # type: ignore[arg-type]


# -- policy registry and pluggable policies -----------------------------------------


class NaiveLRU(CachePolicy):
    """An out-of-tree policy written without any speed tricks."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: OrderedDict[OffloadKey, int] = OrderedDict()

    def get(self, key: OffloadKey) -> int | None:
        return self.blocks.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def items(self) -> Iterator[tuple[OffloadKey, int]]:
        return iter(list(self.blocks.items()))

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        for k, b in zip(keys, block_ids, strict=True):
            self.blocks[k] = b

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            del self.blocks[k]

    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        for k in reversed(keys):
            if k in self.blocks:
                self.blocks.move_to_end(k)

    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        chosen = [k for k in self.blocks if not any(k in c for c in exclude)][:n]
        if len(chosen) < n:
            return None
        return chosen, [self.blocks.pop(k) for k in chosen]


def test_builtin_names_resolve() -> None:
    assert resolve_policy("lru") is LRUCachePolicy
    assert resolve_policy("arc") is ARCCachePolicy
    assert resolve_policy(NaiveLRU) is NaiveLRU


@pytest.mark.parametrize("sep", [":", "."])
def test_out_of_tree_policy_by_module_path_makes_lru_decisions(sep: str) -> None:
    naive = CPUOffloadingManager(3, f"{__name__}{sep}NaiveLRU")
    fast = CPUOffloadingManager(3, "lru")
    assert isinstance(naive.policy, NaiveLRU)
    for manager in (naive, fast):
        for batch in ([key(0), key(1)], [key(2)], [key(3), key(4)]):
            manager.touch([key(0)])
            out = manager.prepare_store(batch, CTX)
            assert out is not None
            manager.complete_store(out.keys_to_store)
    assert list(naive.policy.items()) == list(fast.policy.items())


@pytest.mark.parametrize(
    "name", ["fifo", "no_such_module_xyz:Policy", f"{__name__}:Missing", f"{__name__}:key", ""]
)
def test_unknown_policy_names_the_bad_value(name: str) -> None:
    with pytest.raises(UnknownPolicyError, match=repr(name)):
        CPUOffloadingManager(4, name)


def test_a_class_that_is_not_a_policy_is_rejected() -> None:
    with pytest.raises(UnknownPolicyError, match="dict"):
        resolve_policy(dict)  # type: ignore[arg-type]


# -- reuse filter ---------------------------------------------------------------------


def _filtered(size: int = 64) -> FilterReusedOffloadingManager:
    return FilterReusedOffloadingManager(CPUOffloadingManager(8), 2, max_tracker_size=size)


@pytest.mark.parametrize("pending", [False, True])
def test_lookup_prefix_counts_exactly_what_a_lookup_loop_would(pending: bool) -> None:
    keys = [key(i) for i in range(6)]
    by_loop, by_prefix = _filtered(), _filtered()
    for manager in (by_loop, by_prefix):
        for _ in range(2):  # make keys 0-3 eligible, then store them
            for k in keys[:4]:
                manager.lookup(k, CTX)
        manager.prepare_store(keys[:4], CTX)
        if not pending:
            manager.complete_store(keys[:2])  # 0, 1 ready; 2, 3 still writing
        else:
            manager.complete_store(keys[:1])
    loop_answer: int | None = 0
    for k in keys:
        found = by_loop.lookup(k, CTX)
        if found is None:
            loop_answer = None
            break
        if not found:
            break
        assert loop_answer is not None
        loop_answer += 1
    assert by_prefix.lookup_prefix(iter(keys), CTX) == loop_answer
    assert by_prefix.counts == by_loop.counts


def test_tracker_drops_the_oldest_key_when_full() -> None:
    manager = _filtered(size=2)
    for i in (0, 1, 0, 2):
        manager.lookup(key(i), CTX)
    assert list(manager.counts.items()) == [(key(0), 2), (key(2), 1)]
    out = manager.prepare_store([key(0), key(1), key(2)], CTX)
    assert out is not None and out.keys_to_store == [key(0)]


@pytest.mark.parametrize(
    ("threshold", "size", "bad"), [(1, 10, "store_threshold"), (2, 0, "max_tracker_size")]
)
def test_reuse_filter_rejects_bad_settings(threshold: int, size: int, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        FilterReusedOffloadingManager(CPUOffloadingManager(1), threshold, size)


def test_reuse_filter_delegates_events_and_shutdown() -> None:
    backing = CPUOffloadingManager(2, enable_events=True)
    manager = FilterReusedOffloadingManager(backing)
    for _ in range(2):
        manager.lookup(key(0), CTX)
    out = manager.prepare_store([key(0)], CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    events = list(manager.take_events())
    assert [(e.keys, e.removed) for e in events] == [([key(0)], False)]
    manager.shutdown()
    assert len(backing.sink) == 0


# -- prefix_len: the C-level run and where it stopped -----------------------------


@pytest.mark.parametrize("policy_cls", [LRUCachePolicy, ARCCachePolicy])
@pytest.mark.parametrize("shape", [list, tuple, iter])
def test_prefix_len_counts_the_cached_run_for_every_input_shape(
    policy_cls: type[CachePolicy], shape: type
) -> None:
    # ``prefix_len`` stops a C ``all`` at the first miss and reads the position
    # off the list iterator; the answer must be the plain loop's, wherever the
    # miss is (first key, middle, none) and whichever ARC list holds the keys.
    rng = random.Random(7)
    policy = policy_cls(64)
    cached = [key(i) for i in range(40)]
    policy.insert(cached, list(range(40)))
    policy.touch(cached[::2], writing=set())  # ARC: even keys move to T2
    absent = [key(100 + i) for i in range(20)]
    for _ in range(200):
        n = rng.randrange(0, 12)
        keys = [rng.choice(cached) for _ in range(n)]
        if rng.random() < 0.7:
            keys.insert(rng.randrange(0, n + 1), rng.choice(absent))
        want = 0
        for k in keys:
            if k not in policy:
                break
            want += 1
        assert policy.prefix_len(shape(keys)) == want
