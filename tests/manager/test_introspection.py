"""Both built-in managers answer the same questions, including why a store was refused.

``get_manager()`` returns a ``FilterReusedOffloadingManager`` once
``store_threshold >= 2``; code that asks ``num_free_blocks``,
``block_status`` or ``len()`` must not break when that switch is flipped.
``prepare_store`` returning None is explained by ``store_refusal``.
"""

from __future__ import annotations

import pytest

from aiokvo.config import OffloadConfig
from aiokvo.errors import CapacityError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.base import OffloadingManager, StoreRefusal
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.offloading_spec import CPUOffloadingSpec
from aiokvo.specs import ReqContext

CTX = ReqContext()


def k(i: int) -> OffloadKey:
    return make_offload_key(bytes([i + 1]) * 8, 0)


KEYS = [k(i) for i in range(6)]


def managers(num_blocks: int = 3) -> list[OffloadingManager]:
    return [
        CPUOffloadingManager(num_blocks),
        FilterReusedOffloadingManager(CPUOffloadingManager(num_blocks), store_threshold=2),
    ]


def seen_twice(m: OffloadingManager, keys: list[OffloadKey]) -> None:
    for key in keys * 2:
        m.lookup(key, CTX)


@pytest.mark.parametrize("m", managers(), ids=["cpu", "reuse"])
def test_pool_size_free_blocks_status_and_len(m: OffloadingManager) -> None:
    seen_twice(m, KEYS[:2])
    out = m.prepare_store(KEYS[:2], CTX)
    assert out is not None
    assert m.num_blocks == 3
    assert m.num_free_blocks == 1
    assert len(m) == 2  # type: ignore[arg-type]
    status = m.block_status(KEYS[0])
    assert status is not None and status.ref_cnt == -1 and status.block_id == 0
    m.complete_store(out.reservation)
    status = m.block_status(KEYS[1])
    assert status is not None and status.is_ready
    assert m.block_status(KEYS[5]) is None


def test_the_spec_gives_a_manager_with_the_same_answers_whatever_the_threshold() -> None:
    for threshold in (0, 2):
        config = OffloadConfig(
            gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=64,
            cpu_bytes_to_use=64 * 4, store_threshold=threshold,
        )
        manager = CPUOffloadingSpec(config).get_manager()
        assert (manager.num_blocks, manager.num_free_blocks) == (4, 4)
        assert len(manager) == 0  # type: ignore[arg-type]
        assert manager.block_status(KEYS[0]) is None
        assert manager.store_refusal is None


@pytest.mark.parametrize("m", managers(), ids=["cpu", "reuse"])
def test_a_request_larger_than_the_pool_never_fits(m: OffloadingManager) -> None:
    seen_twice(m, KEYS[:4])
    assert m.prepare_store(KEYS[:4], CTX) is None
    refusal = m.store_refusal
    assert refusal == StoreRefusal(needed=4, free=3, num_blocks=3)
    assert refusal.never_fits
    error = refusal.error()
    assert isinstance(error, CapacityError)
    assert "4 new blocks can never fit a pool of 3" in str(error)


@pytest.mark.parametrize("m", managers(), ids=["cpu", "reuse"])
def test_a_request_blocked_by_busy_blocks_may_fit_later(m: OffloadingManager) -> None:
    seen_twice(m, KEYS[:5])
    first = m.prepare_store(KEYS[:3], CTX)  # all three being written
    assert first is not None
    assert m.prepare_store(KEYS[3:5], CTX) is None
    refusal = m.store_refusal
    assert refusal is not None and not refusal.never_fits
    assert (refusal.needed, refusal.free) == (2, 0)
    assert "could not evict the other 2" in str(refusal)
    m.complete_store(first.reservation)
    assert m.prepare_store(KEYS[3:5], CTX) is not None
    assert m.store_refusal is None  # cleared by the store that went through


def test_a_manager_that_does_not_say_answers_none() -> None:
    from tests.manager._seed_reference import RefCPUManager

    ref = RefCPUManager(1)
    assert ref.prepare_store(KEYS[:2], CTX) is None
    assert ref.store_refusal is None
    with pytest.raises(NotImplementedError, match="num_free_blocks"):
        ref.num_free_blocks  # noqa: B018
