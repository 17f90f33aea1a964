"""ARC eviction through the manager (seed 5.3), on hand-worked scenarios.

New keys enter T1; a touch promotes a ready T1 key to T2 (a block still
being written only moves to T1's recent end), moves a T2 key to T2's end,
and a touch of a ghost key (B1/B2, keys evicted from T1/T2) moves
``target_t1_size`` by ``max(1, |B2|/|B1|)`` up or ``max(1, |B1|/|B2|)``
down, clamped to ``[0, capacity]``. Each victim comes from T1 while the
shrinking T1 size is ``>= int(target)`` and T1 has an idle, unprotected key,
otherwise from T2; if T2 has none either, nothing is evicted. Ghost lists
keep at most ``capacity`` keys, dropping the oldest.

The comments give the state after each step as T1/T2/B1/B2 (oldest first)
and the target.
"""

from __future__ import annotations

from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, ReqContext

CTX = ReqContext()


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


a, b, c, d, e, f, g, h, i, j, q = (k(n) for n in "abcdefghijq")


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def arc(num_blocks: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_blocks, cache_policy="arc")


def put(m: CPUOffloadingManager, *keys: OffloadKey) -> tuple[list[int], list[OffloadKey]]:
    """prepare_store + complete_store; returns (block ids, evicted keys)."""
    out = m.prepare_store(list(keys), CTX)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return ids(out.store_spec), out.evicted_keys


def begin(m: CPUOffloadingManager, *keys: OffloadKey) -> tuple[list[int], list[OffloadKey]]:
    """prepare_store only: the blocks stay 'being written'."""
    out = m.prepare_store(list(keys), CTX)
    assert out is not None
    return ids(out.store_spec), out.evicted_keys


def test_t1_is_evicted_before_more_recent_t2_keys() -> None:
    m = arc(3)
    put(m, a, b)
    m.touch([a])  # T1 b | T2 a
    put(m, c)  # T1 b c | T2 a   (LRU would have b, a, c)
    assert put(m, d, e) == ([2, 1], [b, c])


def test_touch_promotes_in_reverse_so_the_first_key_is_most_recent() -> None:
    m = arc(3)
    put(m, a, b, c)
    m.touch([a, b, c])  # T2 c b a
    assert put(m, d, e) == ([1, 2], [c, b])  # T1 empty, so T2 gives its oldest


def test_touch_refreshes_but_does_not_promote_a_block_being_written() -> None:
    m = arc(3)
    begin(m, a)
    put(m, b)
    m.touch([a])  # a is not ready: T1 b a (not promoted)
    m.complete_store([a])
    put(m, c)  # T1 b a c
    assert put(m, d, e) == ([0, 1], [b, a])


def test_touch_promotes_a_block_being_read() -> None:
    m = arc(3)
    put(m, a, b, c)
    m.prepare_load([a], CTX)
    m.touch([a])  # T1 b c | T2 a
    m.complete_load([a])
    assert put(m, d, e) == ([2, 1], [b, c])


def test_touch_moves_a_t2_key_to_the_back_of_t2() -> None:
    m = arc(3)
    put(m, a, b, c)
    m.touch([c, b, a])  # T2 a b c
    m.touch([a])  # T2 b c a
    assert put(m, d) == ([1], [b])


def test_falls_back_to_t2_when_t1_has_nothing_evictable() -> None:
    m = arc(2)
    put(m, a)
    m.touch([a])  # T2 a
    begin(m, b)  # T1 b (being written)
    assert begin(m, c) == ([0], [a])


def test_does_not_fall_back_to_t1_when_t1_is_below_target() -> None:
    m = arc(2)
    put(m, a, b)
    m.touch([a])  # T1 b | T2 a
    assert put(m, c) == ([1], [b])  # T1 c | T2 a | B1 b
    m.touch([b])  # B1 hit: target 0 + max(1, 0/1) = 1
    m.prepare_load([a], CTX)
    # T1 has 1 key, 1 >= int(1): c goes first.
    assert put(m, d) == ([1], [c])  # T1 d | T2 a | B1 b c
    m.touch([c])  # target 2
    # Now |T1| = 1 < 2, so only T2 is searched; a is being read.
    assert m.prepare_store([e], CTX) is None
    m.complete_load([a])
    assert put(m, e) == ([0], [a])


def test_ghost_hits_in_b1_raise_the_target_until_t2_is_evicted() -> None:
    m = arc(3)
    put(m, a, b, c)
    m.touch([a])  # T1 b c | T2 a
    assert put(m, d) == ([1], [b])  # T1 c d | B1 b
    m.touch([b])  # target 1
    assert put(m, e) == ([2], [c])  # |T1| 2 >= 1: T1 d e | B1 b c
    m.touch([c])  # target 2
    assert put(m, f) == ([1], [d])  # 2 >= 2: T1 e f | B1 b c d
    m.touch([d])  # target 3
    assert put(m, g) == ([0], [a])  # 2 < 3: T2 gives a; T1 e f g | B2 a


def test_b2_hit_lowers_the_target_by_the_ghost_ratio() -> None:
    m = arc(3)
    put(m, a, b, c)
    m.touch([a])  # T1 b c | T2 a
    put(m, d)  # evicts b: T1 c d | B1 b
    m.touch([b])  # target 1
    put(m, e)  # evicts c: T1 d e | B1 b c
    m.touch([c])  # target 2
    put(m, f)  # evicts d: T1 e f | B1 b c d
    m.touch([d])  # target 3
    put(m, g)  # evicts a from T2: T1 e f g | B2 a
    m.touch([e])  # T1 f g | T2 e
    m.touch([a])  # B2 hit: target 3 - max(1, |B1| 3 / |B2| 1) = 0 (a step of 1 would give 2)
    # With target 0 both victims come from T1 (with target 2 the second would be e).
    assert put(m, h, i) == ([0, 1], [f, g])


def test_b1_hit_raises_the_target_by_the_ghost_ratio() -> None:
    m = arc(4)
    put(m, a, b, c, d)
    m.touch([d, c, b, a])  # T2 a b c d
    assert begin(m, e) == ([0], [a])  # T1 has nothing idle: T2 gives a
    assert begin(m, f) == ([1], [b])
    assert begin(m, g) == ([2], [c])  # T1 e f g (written) | T2 d | B2 a b c
    m.complete_store([e, f, g])
    assert put(m, h) == ([0], [e])  # T1 f g h | B1 e
    m.touch([e])  # target 0 + max(1, |B2| 3 / |B1| 1) = 3
    # First victim: |T1| 3 >= 3 gives f; then 2 < 3 sends the second to T2.
    assert put(m, i, j) == ([3, 1], [f, d])


def test_fractional_target_is_truncated_when_choosing_a_list() -> None:
    m = arc(4)
    put(m, a, b, c, d)
    m.touch([d, c, b, a])  # T2 a b c d
    begin(m, e)
    begin(m, f)
    begin(m, g)  # T1 e f g (written) | T2 d | B2 a b c
    m.complete_store([e, f, g])
    assert put(m, h, i) == ([1, 0], [e, f])  # T1 g h i | B1 e f
    m.touch([e])  # target 0 + 3/2 = 1.5
    # T1 sizes 3, 2, 1 are all >= int(1.5) = 1, so all three victims come from T1.
    assert put(m, j, q, a) == ([0, 1, 2], [g, h, i])


def test_target_never_exceeds_the_capacity() -> None:
    m = arc(1)
    put(m, a)
    assert put(m, b) == ([0], [a])  # T1 b | B1 a
    m.touch([a, a])  # target min(1 + 1, 1) = 1, not 2
    # Storing a again: |T1| 1 >= 1, so b goes (a target of 2 would look in empty T2).
    assert put(m, a) == ([0], [b])


def test_ghost_lists_are_trimmed_to_capacity_oldest_first() -> None:
    m = arc(2)
    put(m, f, e)
    assert put(m, a) == ([0], [f])  # T1 e a | B1 f
    assert put(m, h, g) == ([0, 1], [e, a])  # B1 f e a, trimmed to e a
    m.touch([e, f])  # f is forgotten; e is a B1 hit: target 1
    out = m.prepare_store([e, c], CTX)
    assert out is not None  # a target of 2 would send the second victim to empty T2
    assert (ids(out.store_spec), out.evicted_keys) == ([1, 0], [h, g])


def test_storing_a_ghost_key_forgets_its_ghost() -> None:
    m = arc(2)
    put(m, g, d)
    assert put(m, f) == ([0], [g])  # T1 d f | B1 g
    assert put(m, f, g) == ([1], [d])  # f protected; g leaves B1: B1 d
    assert put(m, b, c) == ([1, 0], [f, g])  # B1 d f g, trimmed to f g
    m.touch([g, g])  # two B1 hits: target 2
    # |T1| 2 >= 2 gives b, then 1 < 2 and T2 is empty: nothing can be stored.
    assert m.prepare_store([g, a], CTX) is None


def test_failed_store_does_not_leave_a_ghost() -> None:
    m = arc(2)
    put(m, a)
    m.touch([a])  # T2 a
    begin(m, b)
    m.complete_store([b], success=False)  # removed, not evicted: B1 stays empty
    assert put(m, c) == ([1], [])  # T1 c | T2 a
    m.touch([b, b])  # b is unknown: the target stays 0 (as a ghost it would be 2)
    assert put(m, d) == ([1], [c])
