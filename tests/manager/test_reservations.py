"""Store reservations: only the caller that reserved keys completes them.

``prepare_store`` returns a ``reservation`` with its output;
``complete_store(out.reservation, success)`` completes exactly the keys that
reservation still holds. Keys-only ``complete_store`` keeps the seed's
contract (any key being written is completed, unknown ones are ignored).
"""

from __future__ import annotations

import pytest

from aiokvo.errors import StaleReservationError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    StoreReservation,
)
from tests.manager._seed_reference import RefCPUManager

CTX = ReqContext()

pytestmark = pytest.mark.parametrize("policy", ["lru", "arc"])


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


a, b, c, d = (k(n) for n in "abcd")


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def reserve(m: CPUOffloadingManager, keys: list[OffloadKey]) -> PrepareStoreOutput:
    out = m.prepare_store(keys, CTX)
    assert out is not None
    return out


def state(m: CPUOffloadingManager, keys: list[OffloadKey]) -> object:
    statuses = [m.block_status(key) for key in keys]
    return [None if s is None else (s.block_id, s.ref_cnt) for s in statuses], m.num_free_blocks


def test_a_reservation_completes_its_keys(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    out = reserve(m, [a, b])
    assert out.reservation.keys == (a, b) and out.reservation.open
    m.complete_store(out.reservation, success=True)
    assert not out.reservation.open and out.reservation.completed
    assert repr(out.reservation) == "<StoreReservation completed, 2 keys>"
    assert m.lookup(a, CTX) is True and m.lookup(b, CTX) is True
    assert list(m.take_events()) == [OffloadingEvent([a, b], "CPU", False)]


def test_a_stale_reservation_does_not_complete_keys_prepared_again(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    first = reserve(m, [a])
    m.complete_store(first.reservation, success=False)  # the copy failed
    second = reserve(m, [a])  # someone else stores the same key
    before = state(m, [a])
    with pytest.raises(StaleReservationError, match="already completed"):
        m.complete_store(first.reservation, success=True)  # a late, stale call
    assert state(m, [a]) == before
    assert m.lookup(a, CTX) is None  # still being written by the second store
    assert list(m.take_events()) == []
    m.complete_store(second.reservation)
    assert m.lookup(a, CTX) is True


def test_keys_failed_by_a_key_list_and_reserved_again_stay_with_the_new_store(
    policy: str,
) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    first = reserve(m, [a, b])
    m.complete_store([a], success=False)  # a key-list call fails a alone
    second = reserve(m, [a])  # and a is reserved again
    m.complete_store(first.reservation, success=True)  # completes b only
    assert m.lookup(b, CTX) is True
    assert m.lookup(a, CTX) is None
    status = m.block_status(a)
    assert status is not None and status.ref_cnt == -1
    m.complete_store(second.reservation, success=False)
    assert m.lookup(a, CTX) is False


def test_passing_all_of_a_requests_keys_with_a_reservation_touches_only_its_own(
    policy: str,
) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    theirs = reserve(m, [a, b])  # another request is writing a and b
    mine = reserve(m, [a, b, c])  # this request reserves only c
    assert mine.keys_to_store == [c]
    m.complete_store(mine.reservation, success=True)
    assert [m.lookup(key, CTX) for key in (a, b, c)] == [None, None, True]
    m.complete_store(theirs.reservation, success=False)
    assert [m.lookup(key, CTX) for key in (a, b, c)] == [False, False, True]


def test_keys_only_completion_keeps_the_seed_contract(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    reserve(m, [a, b])
    reserve(m, [c])
    m.complete_store([a, b, c, d], success=True)  # d unknown: ignored
    assert [m.lookup(key, CTX) for key in (a, b, c, d)] == [True, True, True, False]


def test_a_failed_reservation_frees_exactly_its_blocks(policy: str) -> None:
    m = CPUOffloadingManager(3, cache_policy=policy)
    first = reserve(m, [a, b])  # blocks 0, 1
    reserve(m, [c])  # block 2
    m.complete_store(first.reservation, success=False)
    assert m.num_free_blocks == 2
    assert m.block_status(a) is None and m.block_status(b) is None
    status = m.block_status(c)
    assert status is not None and status.ref_cnt == -1
    assert ids(reserve(m, [d]).store_spec) == [1]  # the last freed first


def test_a_reservation_completes_once(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    out = reserve(m, [a])
    m.complete_store(out.reservation)
    with pytest.raises(StaleReservationError):
        m.complete_store(out.reservation)
    with pytest.raises(StaleReservationError):
        m.complete_store(out.reservation, success=False)
    assert m.lookup(a, CTX) is True  # the second call did not free it


def test_another_managers_reservation_is_refused_and_changes_nothing(policy: str) -> None:
    mine = CPUOffloadingManager(4, cache_policy=policy)
    other = CPUOffloadingManager(4, cache_policy=policy)
    reserve(mine, [a])
    foreign = reserve(other, [a])
    before = state(mine, [a])
    with pytest.raises(StaleReservationError, match="another manager"):
        mine.complete_store(foreign.reservation)
    assert state(mine, [a]) == before and foreign.reservation.open


def test_a_partly_completed_reservation_completes_the_rest(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    out = reserve(m, [a, b, c])
    m.complete_store([b])
    m.complete_store(out.reservation)
    assert list(m.take_events()) == [
        OffloadingEvent([b], "CPU", False),
        OffloadingEvent([a, c], "CPU", False),
    ]


def test_an_output_with_nothing_to_store_has_a_reservation_too(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    m.complete_store(reserve(m, [a]).reservation)
    m.take_events()
    out = reserve(m, [a])
    assert out.keys_to_store == [] and len(out.reservation) == 0
    m.complete_store(out.reservation, success=False)
    assert m.lookup(a, CTX) is True and list(m.take_events()) == []


def test_the_reservation_is_a_copy_of_the_keys(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    out = reserve(m, [a, b])
    out.keys_to_store.clear()  # the caller's list is its own
    m.complete_store(out.reservation)
    assert m.lookup(a, CTX) is True and m.lookup(b, CTX) is True


def test_the_reuse_filter_passes_reservations_through(policy: str) -> None:
    backing = CPUOffloadingManager(4, cache_policy=policy)
    m = FilterReusedOffloadingManager(backing, store_threshold=2)
    for _ in range(2):
        m.lookup(a, CTX)
    first = m.prepare_store([a], CTX)
    assert first is not None and first.keys_to_store == [a]
    m.complete_store(first.reservation, success=False)
    second = m.prepare_store([a], CTX)
    assert second is not None
    with pytest.raises(StaleReservationError):
        m.complete_store(first.reservation)
    assert m.lookup(a, CTX) is None


def test_outputs_built_positionally_get_a_key_list_reservation(policy: str) -> None:
    # A manager that predates reservations (the seed model here) builds its
    # output from three fields; its reservation then completes as the keys.
    ref = RefCPUManager(4, cache_policy=policy)
    out = ref.prepare_store([a, b], CTX)
    assert out is not None
    assert isinstance(out.reservation, StoreReservation)
    assert list(out.reservation) == [a, b] and not out.reservation.open
    ref.complete_store(out.reservation)
    assert ref.lookup(a, CTX) is True and ref.lookup(b, CTX) is True
    # ... and is not open in a manager that does track them.
    m = CPUOffloadingManager(4, cache_policy=policy)
    reserve(m, [a, b])
    with pytest.raises(StaleReservationError, match="key list"):
        m.complete_store(out.reservation)
    assert m.lookup(a, CTX) is None
