"""The Offloader: each call's workflow, its waits, its cancellation and its errors.

Copies run on the host backend; :class:`Copies` (a ``copy_fn``) holds them
back or fails them where a test needs a copy in flight or a failed one, and
:class:`CountingManager` checks every ``complete_*`` against what is open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

from aiokvo import CPULoadStoreSpec, GPULoadStoreSpec, Offloader, PrefixLease, StoreResult
from aiokvo.errors import (
    ConfigError,
    InvalidKeyError,
    InvalidSpecError,
    LeaseError,
    OffloaderClosedError,
    TransferSpecError,
)
from tests.offloader._harness import KV, Copies, CountingManager, counting_config, keys


async def settle(off: Offloader) -> None:
    """Wait until no copy is in flight (``drain`` covers the ones started so far)."""
    await off.drain()
    assert off.statistics().loads_in_flight == off.statistics().stores_in_flight == 0


def counting(off: Offloader) -> CountingManager:
    assert isinstance(off.manager, CountingManager)
    return off.manager


def assert_idle(off: Offloader) -> None:
    """Nothing pinned, written, leased or waited for; every completion matched."""
    s = off.statistics()
    assert (s.loads_in_flight, s.stores_in_flight, s.writing_keys, s.active_leases) == (0,) * 4
    assert (s.manager.writing_blocks, s.manager.pinned_blocks, s.waiters) == (0, 0, 0)
    manager = counting(off)
    assert manager.violations == []
    assert not manager.open_stores and not manager.open_loads


@pytest.fixture
def copies() -> Copies:
    return Copies()


@pytest.fixture
async def setup(copies: Copies) -> AsyncIterator[tuple[Offloader, KV]]:
    kv = KV(64)
    async with Offloader(
        counting_config(kv, 8), kv.caches, handler_options={"copy_fn": copies}
    ) as off:
        yield off, kv
        copies.gate.set()


# -- the round trip ----------------------------------------------------------------


@pytest.mark.both_loops
async def test_store_then_load_prefix_moves_every_byte(setup: tuple[Offloader, KV]) -> None:
    off, kv = setup
    a, b, c, d = keys("a", "b", "c", "d")
    kv.write([0, 1, 2], [a, b, c])
    result = await off.store([a, b, c], [0, 1, 2])
    assert result == StoreResult(stored=(a, b, c)) and result.ok
    assert await off.load_prefix([a, b, c, d], [10, 11, 12, 13]) == 3
    assert kv.holds([10, 11, 12], [a, b, c])
    assert not kv.layers[0][0][13].any()  # the miss's block is left alone
    s = off.statistics()
    assert (s.hit_blocks, s.miss_blocks, s.blocks_loaded, s.blocks_stored) == (3, 1, 3, 3)
    assert s.store_bytes == s.load_bytes == 3 * kv.caches.page_bytes_per_block
    assert s.store_transfers == s.load_transfers == 1
    assert s.worker.handlers[0].completed == 1 and s.poller is not None
    assert_idle(off)


async def test_engine_tensors_are_accepted_as_they_are() -> None:
    layers = [torch.randn(16, 8, 4).to(torch.bfloat16) for _ in range(2)]
    kv = KV(16)  # only for a config of the same page size
    page = layers[0][0].numel() * 2 * 2
    config = dataclasses.replace(kv.config(4), kv_bytes_per_block=page)
    async with Offloader(config, layers) as off:
        k = keys("x")
        assert (await off.store(k, [3])).stored == tuple(k)
        assert await off.load_prefix(k, [9]) == 1
    assert all(torch.equal(t[9], t[3]) for t in layers)


async def test_store_skips_held_keys_and_duplicates_and_reports_evictions(
    setup: tuple[Offloader, KV],
) -> None:
    off, kv = setup
    first = keys(*"abcdefgh")  # the pool holds 8
    kv.write(range(8), first)
    assert (await off.store(first, range(8))).stored == tuple(first)
    x, y = keys("x", "y")
    kv.write([8, 9, 10], [x, first[0], y])
    result = await off.store([x, first[0], x, y], [8, 9, 8, 10])
    assert result.stored == (x, y)
    assert result.skipped == (first[0],)  # held; the second x is the same key
    assert len(result.evicted) == 2 and set(result.evicted) <= set(first[1:])
    assert await off.load_prefix([x, y], [20, 21]) == 2
    assert kv.holds([20, 21], [x, y])  # x came from its first block, 8
    assert off.statistics().blocks_evicted == 2
    assert_idle(off)


async def test_a_pool_that_cannot_make_room_fails_the_store(setup: tuple[Offloader, KV]) -> None:
    off, kv = setup
    held = keys(*"abcdefgh")
    kv.write(range(8), held)
    await off.store(held, range(8))
    lease = off.pin_prefix(held)  # pinned: nothing can be evicted
    assert lease is not None and lease.count == 8
    result = await off.store(keys("x"), [9])
    assert result == StoreResult(refused=tuple(keys("x"))) and not result.ok
    assert result.failed == ()  # no copy failed: there was no room to make one
    s = off.statistics()
    assert (s.stores_refused, s.blocks_store_refused, s.blocks_store_failed) == (1, 1, 0)
    lease.release()
    assert (await off.store(keys("x"), [9])).stored == tuple(keys("x"))
    assert_idle(off)


async def test_refused_stores_are_logged_once_per_burst_with_the_reason(
    setup: tuple[Offloader, KV], caplog: pytest.LogCaptureFixture
) -> None:
    """The first burst is a WARNING naming the pool's numbers and where the sizing rule
    is; later bursts are one INFO line each; stores inside a burst log nothing."""
    off, kv = setup
    held = keys(*"abcdefgh")
    kv.write(range(8), held)
    await off.store(held, range(8))
    caplog.set_level(logging.INFO, logger="aiokvo.offloader")
    lease = off.pin_prefix(held)
    assert lease is not None
    for name in "xyz":  # one burst of three refusals
        assert (await off.store(keys(name), [9])).refused == tuple(keys(name))
    records = [r for r in caplog.records if r.name.startswith("aiokvo.offloader")]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "refused 1 key" in message
    assert "CPU pool of 8 blocks" in message and "8 pinned" in message
    assert "docs/tiers.md" in message
    lease.release()
    stored = await off.store(keys("x"), [9])  # the burst ends
    assert stored.stored == tuple(keys("x"))
    lease = off.pin_prefix([k for k in held if k not in stored.evicted] + keys("x"))
    assert lease is not None and lease.count == 8
    assert (await off.store(keys("y"), [10])).refused == tuple(keys("y"))  # a second burst
    records = [r for r in caplog.records if r.name.startswith("aiokvo.offloader")]
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]
    assert "refused 1 key" in records[1].getMessage()
    lease.release()
    assert_idle(off)


async def test_a_failed_store_copy_leaves_nothing_readable(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    copies.fail_all = True
    result = await off.store(ks, [0, 1])
    assert result == StoreResult(failed=tuple(ks))
    copies.fail_all = False
    assert await off.load_prefix(ks, [5, 6]) == 0
    assert off.statistics().manager.free_blocks == 8  # released again
    assert (await off.store(ks, [0, 1])).stored == tuple(ks)
    assert_idle(off)


async def test_a_failed_load_copy_returns_zero_and_releases_its_pins(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    await off.store(ks, [0, 1])
    copies.fail_all = True
    assert await off.load_prefix(ks, [5, 6]) == 0
    s = off.statistics()
    assert (s.blocks_load_failed, s.load_transfer_failures, s.manager.pinned_blocks) == (2, 1, 0)
    copies.fail_all = False
    assert await off.load_prefix(ks, [5, 6]) == 2 and kv.holds([5, 6], ks)
    assert_idle(off)


# -- stores in flight: load_prefix and ready wait for them ---------------------------


async def _store_in_flight(
    off: Offloader, kv: KV, copies: Copies, ks: list[bytes], blocks: list[int]
) -> asyncio.Task[StoreResult]:
    kv.write(blocks, ks)  # type: ignore[arg-type]
    copies.gate.clear()
    task = asyncio.ensure_future(off.store(ks, blocks))  # type: ignore[arg-type]
    while off.statistics().stores_in_flight == 0:
        await asyncio.sleep(0)
    return task


@pytest.mark.both_loops
async def test_load_prefix_waits_for_a_store_of_its_prefix_then_loads(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    a, b, c = keys("a", "b", "c")
    kv.write([0], [a])
    await off.store([a], [0])
    store = await _store_in_flight(off, kv, copies, [b, c], [1, 2])
    load = asyncio.ensure_future(off.load_prefix([a, b, c], [10, 11, 12]))
    await asyncio.sleep(0.02)
    assert not load.done()  # waiting for the store, not polling past it
    assert off.statistics().waiters == 1
    copies.gate.set()
    assert (await store).stored == (b, c)
    assert await load == 3 and kv.holds([10, 11, 12], [a, b, c])
    s = off.statistics()
    assert (s.store_waits, s.polled_waits) == (1, 0)
    assert_idle(off)


async def test_a_store_that_fails_ends_the_prefix_at_its_key(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    a, b, c = keys("a", "b", "c")
    kv.write([0], [a])
    await off.store([a], [0])
    copies.fail_next = 1  # the store's copy, not the load's after it
    store = await _store_in_flight(off, kv, copies, [b, c], [1, 2])
    load = asyncio.ensure_future(off.load_prefix([a, b, c], [10, 11, 12]))
    await asyncio.sleep(0.01)
    copies.gate.set()
    assert (await store).failed == (b, c)
    assert await load == 1 and kv.holds([10], [a])
    assert_idle(off)


async def test_ready_returns_at_once_for_keys_nobody_is_writing(
    setup: tuple[Offloader, KV],
) -> None:
    off, _ = setup
    coroutine = off.ready(keys("a", "b"))
    with pytest.raises(StopIteration):  # finished without ever suspending
        coroutine.send(None)


@pytest.mark.both_loops
@pytest.mark.parametrize("fail", [False, True])
async def test_ready_wakes_every_waiter_when_the_store_ends(
    setup: tuple[Offloader, KV], copies: Copies, fail: bool
) -> None:
    off, kv = setup
    ks = keys("a", "b", "c")
    copies.fail_all = fail
    store = await _store_in_flight(off, kv, copies, ks, [0, 1, 2])
    waiters = [asyncio.ensure_future(off.ready(ks[i % 3 :])) for i in range(12)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiters)
    assert off.statistics().waiters == 12
    copies.gate.set()
    await asyncio.wait_for(asyncio.gather(*waiters), 10)
    assert (await store).ok is not fail
    assert off.statistics().waiters == 0
    assert_idle(off)


async def test_cancelling_a_ready_waiter_leaves_the_others(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a")
    store = await _store_in_flight(off, kv, copies, ks, [0])
    first, second = (asyncio.ensure_future(off.ready(ks)) for _ in range(2))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0)
    assert first.cancelled() and not second.done()
    copies.gate.set()
    await asyncio.wait_for(second, 10)
    await store
    assert_idle(off)


# -- pin_prefix and leases -------------------------------------------------------------


async def test_pin_prefix_pins_now_and_load_into_loads_later(
    setup: tuple[Offloader, KV],
) -> None:
    off, kv = setup
    a, b, c = keys("a", "b", "c")
    kv.write([0, 1], [a, b])
    await off.store([a, b], [0, 1])
    lease = off.pin_prefix([a, b, c])
    assert isinstance(lease, PrefixLease)
    assert (lease.count, lease.keys, len(lease.src_spec)) == (2, (a, b), 2)  # type: ignore[arg-type]
    assert off.statistics().manager.pinned_blocks == 2
    assert off.statistics().active_leases == 1
    assert await lease.load_into([20, 21]) == 2 and kv.holds([20, 21], [a, b])
    assert lease.released and off.statistics().manager.pinned_blocks == 0
    lease.release()  # idempotent
    with pytest.raises(LeaseError, match="released"):
        await lease.load_into([20, 21])
    assert_idle(off)


async def test_a_lease_released_unused_gives_its_pins_back(setup: tuple[Offloader, KV]) -> None:
    off, kv = setup
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    await off.store(ks, [0, 1])
    async with off.pin_prefix(ks) as lease:  # type: ignore[union-attr]
        assert off.statistics().manager.pinned_blocks == 2
    assert lease.released
    with pytest.raises(LeaseError):
        await lease.load_into([4, 5])
    miss = off.pin_prefix(keys("z"))
    assert miss is not None and miss.count == 0
    assert await miss.load_into([]) == 0
    assert off.statistics().leases == 1  # a miss holds nothing
    assert_idle(off)


async def test_pin_prefix_is_none_while_its_first_missing_key_is_being_written(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a")
    store = await _store_in_flight(off, kv, copies, ks, [0])
    assert off.pin_prefix(ks) is None
    copies.gate.set()
    await off.ready(ks)
    lease = off.pin_prefix(ks)
    assert lease is not None and lease.count == 1
    lease.release()
    await store
    assert_idle(off)


async def test_releasing_a_lease_while_it_loads_waits_for_the_copy(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a")
    kv.write([0], ks)
    await off.store(ks, [0])
    lease = off.pin_prefix(ks)
    assert lease is not None
    copies.gate.clear()
    load = asyncio.ensure_future(lease.load_into([9]))
    await asyncio.sleep(0.01)
    lease.release()  # the copy still reads the block: the pin stays
    assert off.statistics().manager.pinned_blocks == 1 and not lease.released
    with pytest.raises(LeaseError, match="loading"):
        await lease.load_into([9])
    copies.gate.set()
    assert await load == 1 and lease.released
    assert_idle(off)


# -- GPU block layouts -------------------------------------------------------------------


async def test_block_size_factor_two_covers_two_gpu_blocks_per_key(copies: Copies) -> None:
    kv = KV(32, factor=2)
    async with Offloader(
        counting_config(kv, 4), kv.caches, handler_options={"copy_fn": copies}
    ) as off:
        assert off.block_size_factor == 2
        a, b, c = keys("a", "b", "c")
        kv.write([0, 1, 2, 3, 4, 5], [a, b, c])
        assert (await off.store([a, b, c], [0, 1, 2, 3, 4, 5])).stored == (a, b, c)
        assert await off.load_prefix([a, b], [10, 11, 12, 13]) == 2
        assert kv.holds([10, 11, 12, 13], [a, b])
        kv.write([6, 7], [b])  # b again, from other blocks: skipped, a new key stored
        d = keys("d")[0]
        kv.write([8, 9], [d])
        result = await off.store([b, d], [6, 7, 8, 9])
        assert (result.stored, result.skipped) == ((d,), (b,))
        assert await off.load_prefix([d], [20, 21]) == 1 and kv.holds([20, 21], [d])
        with pytest.raises(TransferSpecError, match="2 keys need 4 GPU block ids"):
            await off.store([a, b], [0, 1])
        assert_idle(off)


async def test_several_groups_take_a_gpu_spec_and_load_common_positions(copies: Copies) -> None:
    kv = KV(32, groups=2)
    async with Offloader(
        counting_config(kv, 16), kv.caches, handler_options={"copy_fn": copies}
    ) as off:
        g0 = keys("a", "b", "c", group=0)
        g1 = keys("a", "b", "c", group=1)
        kv.write([0, 1, 2], g0, group=0)
        kv.write([5, 6], g1[:2], group=1)
        spec = GPULoadStoreSpec([0, 1, 2, 5, 6], [3, 2], [0, 0])
        result = await off.store(g0 + g1[:2], spec)
        assert result.stored == (*g0, *g1[:2])
        # Positions ready in every group: 2 (group 1 has no third key stored).
        dst = GPULoadStoreSpec([10, 11, 12, 20, 21, 22], [3, 3], [0, 0])
        assert await off.load_prefix(g0 + g1, dst) == 2
        assert kv.holds([10, 11], g0[:2], group=0) and kv.holds([20, 21], g1[:2], group=1)
        assert not kv.layers[0][0][12].any() and not kv.layers[1][0][22].any()
        with pytest.raises(TransferSpecError, match="pass a GPULoadStoreSpec"):
            await off.load_prefix(g0, [1, 2, 3])
        lease = off.pin_prefix(g1)
        assert lease is not None and lease.count == 2
        assert await lease.load_into(GPULoadStoreSpec([25, 26], [0, 2], [0, 0])) == 2
        assert kv.holds([25, 26], g1[:2], group=1)
        assert_idle(off)


# -- bad input -----------------------------------------------------------------------------


async def test_bad_input_raises_typed_errors_before_any_state_changes(
    setup: tuple[Offloader, KV],
) -> None:
    off, kv = setup
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    before = off.statistics().manager
    with pytest.raises(TransferSpecError, match=r"2 keys need 2 GPU block ids .* got 3"):
        await off.store(ks, [0, 1, 2])
    with pytest.raises(TransferSpecError, match=r"GPU block id 64 .* out of range"):
        await off.store(ks, [0, 64])
    with pytest.raises(TransferSpecError, match="got 1"):
        await off.load_prefix(ks, [0])
    with pytest.raises(TransferSpecError, match="negative"):
        await off.load_prefix(ks, [0, -3])
    assert off.statistics().manager == before  # nothing was looked up, reserved or pinned
    await off.store(ks, [0, 1])
    lease = off.pin_prefix(ks)
    assert lease is not None
    with pytest.raises(TransferSpecError, match="2 keys need 2"):
        await lease.load_into([5])
    assert not lease.released  # still pinned, still loadable
    assert await lease.load_into([5, 6]) == 2
    with pytest.raises(ConfigError, match="config must be an OffloadConfig"):
        Offloader({"cpu_bytes_to_use": 1}, kv.caches)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_buffered"):
        Offloader(kv.config(4), kv.caches, max_buffered=-1)
    assert_idle(off)


async def test_a_bare_key_is_refused_wherever_a_list_of_keys_is_taken(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    """A key is bytes, so iterating one yields ints: ``ready(key)`` used to return at
    once while that very key was being written."""
    off, kv = setup
    (a,) = keys("a")
    store = await _store_in_flight(off, kv, copies, [a], [0])
    assert off.statistics().writing_keys == 1
    with pytest.raises(InvalidKeyError, match=r"Offloader.ready takes a list of keys, got a bare"):
        await off.ready(a)
    with pytest.raises(InvalidKeyError, match=r"Offloader\.ready: 7 is not an OffloadKey"):
        await off.ready([7])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match=r"Offloader\.load_prefix takes a list of keys"):
        await off.load_prefix(a, [1])
    with pytest.raises(InvalidKeyError, match=r"Offloader\.store takes a list of keys"):
        await off.store(a, [1])
    with pytest.raises(InvalidKeyError, match=r"Offloader\.pin_prefix takes a list of keys"):
        off.pin_prefix(a)
    assert not store.done()  # nothing above waited for, or touched, the store in flight
    copies.gate.set()
    assert (await store).stored == (a,)
    await off.ready((a,))  # a tuple is a list of keys
    assert_idle(off)


async def test_one_gpu_block_named_twice_in_a_load_is_refused(
    setup: tuple[Offloader, KV],
) -> None:
    off, kv = setup
    ks = keys("a", "b", "c")
    kv.write([0, 1, 2], ks)
    await off.store(ks, [0, 1, 2])
    before = off.statistics().manager
    with pytest.raises(TransferSpecError, match=r"GPU block 5 .* twice"):
        await off.load_prefix(ks, [4, 5, 5])
    with pytest.raises(TransferSpecError, match=r"GPU block 5 .* twice"):
        await off.load_prefix(ks, np.array([5, 4, 5]))
    with pytest.raises(TransferSpecError, match=r"GPU block 6 .* twice"):
        await off.load_prefix(ks, GPULoadStoreSpec([6, 7, 6], [3], [0]))
    assert off.statistics().manager == before  # refused before anything was pinned
    lease = off.pin_prefix(ks)
    assert lease is not None
    with pytest.raises(TransferSpecError, match="twice"):
        await lease.load_into([8, 8, 9])
    assert await lease.load_into([8, 9, 10]) == 3
    result = await off.store(keys("d", "e"), [3, 3])  # reading one block twice is harmless
    assert result.stored == tuple(keys("d", "e"))
    assert_idle(off)


@pytest.mark.parametrize("ids", [[0, True], [False, 1], (0, True)])
async def test_a_bool_among_block_ids_is_refused(
    setup: tuple[Offloader, KV], ids: Any
) -> None:
    off, kv = setup
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    with pytest.raises(TransferSpecError, match="bool"):
        await off.store(ks, ids)
    with pytest.raises(TransferSpecError, match="bool"):
        await off.load_prefix(ks, ids)
    with pytest.raises(InvalidSpecError, match="bool"):
        GPULoadStoreSpec(list(ids), [2], [0])
    with pytest.raises(InvalidSpecError, match="bool"):
        CPULoadStoreSpec(list(ids))
    assert off.statistics().stores == 0 or off.statistics().blocks_stored == 0
    assert_idle(off)


async def test_a_closed_offloader_refuses_every_call(copies: Copies) -> None:
    kv = KV(16)
    off = Offloader(counting_config(kv, 4), kv.caches, handler_options={"copy_fn": copies})
    ks = keys("a")
    kv.write([0], ks)
    await off.store(ks, [0])
    lease = off.pin_prefix(ks)
    assert lease is not None
    await off.aclose()
    await off.aclose()  # idempotent
    assert off.closed and off.statistics().closed
    assert lease.released  # released by the close
    for call in (
        off.load_prefix(ks, [1]),
        off.store(ks, [1]),
        off.ready(ks),
        lease.load_into([1]),
    ):
        with pytest.raises((OffloaderClosedError, LeaseError)):
            await call
    with pytest.raises(OffloaderClosedError, match="pin_prefix"):
        off.pin_prefix(ks)
    manager = counting(off)
    assert manager.violations == [] and not manager.open_loads


# -- cancellation and closing with work in flight -------------------------------------------


@pytest.mark.both_loops
async def test_cancelling_a_store_cancels_the_wait_not_the_copy(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a", "b")
    store = await _store_in_flight(off, kv, copies, ks, [0, 1])
    store.cancel()
    with pytest.raises(asyncio.CancelledError):
        await store
    s = off.statistics()
    assert (s.stores_in_flight, s.writing_keys, s.cancelled_waits) == (1, 2, 1)
    assert counting(off).completed_stores == 0  # the copy has not ended: nothing completed
    copies.gate.set()
    await settle(off)
    assert counting(off).completed_stores == 1
    assert await off.load_prefix(ks, [5, 6]) == 2 and kv.holds([5, 6], ks)
    assert_idle(off)


@pytest.mark.both_loops
async def test_cancelling_a_load_keeps_the_pins_until_the_copy_ends(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    await off.store(ks, [0, 1])
    copies.gate.clear()
    load = asyncio.ensure_future(off.load_prefix(ks, [5, 6]))
    while off.statistics().loads_in_flight == 0:
        await asyncio.sleep(0)
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    assert off.statistics().manager.pinned_blocks == 2  # the copy still reads them
    copies.gate.set()
    await settle(off)
    assert kv.holds([5, 6], ks)  # the copy finished after all
    assert_idle(off)


async def test_aclose_lets_copies_in_flight_finish_and_complete(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    a, b = keys("a", "b")
    kv.write([0], [a])
    await off.store([a], [0])
    store = await _store_in_flight(off, kv, copies, [b], [1])
    load = asyncio.ensure_future(off.load_prefix([a], [5]))
    lease = off.pin_prefix([a])
    assert lease is not None
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(off.aclose())
    await asyncio.sleep(0.02)
    assert not closing.done() and not store.done()
    with pytest.raises(OffloaderClosedError):
        await off.store(keys("c"), [2])
    copies.gate.set()
    await asyncio.wait_for(closing, 10)
    assert (await store).stored == (b,)
    assert await load == 1 and kv.holds([5], [a])
    assert lease.released
    manager = counting(off)
    assert manager.violations == [] and not manager.open_stores and not manager.open_loads
    assert manager.completed_stores == 2 and manager.completed_loads == 2  # load + lease


async def test_a_load_waiting_for_a_store_when_the_offloader_closes_raises(
    setup: tuple[Offloader, KV], copies: Copies
) -> None:
    off, kv = setup
    ks = keys("a")
    store = await _store_in_flight(off, kv, copies, ks, [0])
    load = asyncio.ensure_future(off.load_prefix(ks, [5]))
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(off.aclose())
    copies.gate.set()
    await asyncio.wait_for(closing, 10)
    assert (await store).ok
    with pytest.raises(OffloaderClosedError, match="load_prefix"):
        await load


async def test_with_several_groups_a_load_waits_for_a_store_in_any_group(copies: Copies) -> None:
    kv = KV(32, groups=2)
    async with Offloader(
        counting_config(kv, 16), kv.caches, handler_options={"copy_fn": copies}
    ) as off:
        g0 = keys("a", "b", group=0)
        g1 = keys("a", "b", group=1)
        kv.write([0, 1], g0, group=0)
        kv.write([4, 5], g1, group=1)
        await off.store(g0 + g1[:1], GPULoadStoreSpec([0, 1, 4], [2, 1], [0, 0]))
        copies.gate.clear()  # group 1's second key: in flight
        store = asyncio.ensure_future(off.store(g1[1:], GPULoadStoreSpec([5], [0, 1], [0, 1])))
        while off.statistics().stores_in_flight == 0:
            await asyncio.sleep(0)
        dst = GPULoadStoreSpec([10, 11, 20, 21], [2, 2], [0, 0])
        load = asyncio.ensure_future(off.load_prefix(g0 + g1, dst))
        await asyncio.sleep(0.01)
        assert not load.done() and off.statistics().store_waits == 1
        copies.gate.set()
        assert (await store).stored == tuple(g1[1:])
        assert await load == 2
        assert kv.holds([10, 11], g0, group=0) and kv.holds([20, 21], g1, group=1)
        assert_idle(off)


@pytest.mark.parametrize("call", ["store", "load_prefix"])
async def test_a_manager_that_raises_in_complete_still_wakes_the_caller(
    setup: tuple[Offloader, KV], call: str
) -> None:
    off, kv = setup
    seen: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: seen.append(context))
    ks = keys("a")
    kv.write([0], ks)
    if call == "load_prefix":
        await off.store(ks, [0])
    counting(off).explode = RuntimeError("manager bug")
    if call == "store":
        assert (await asyncio.wait_for(off.store(ks, [0]), 10)).stored == tuple(ks)
    else:
        assert await asyncio.wait_for(off.load_prefix(ks, [1]), 10) == 1
    assert [str(c["exception"]) for c in seen] == ["manager bug"]
    assert "complete_" in str(seen[0]["message"])
    assert_idle(off)
