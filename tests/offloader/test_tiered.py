"""The Offloader's tier driver (promotion and write-through) through a real disk tier:
its counters agree with the tier's, and a promotion it cannot start leaks nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.tiers.disk._util import KV, FaultyIO, fill, is_disk_tier, keys, offloader


async def test_tier_write_counters_count_blocks_not_transfers(disk_tier_path: Path) -> None:
    kv = KV()
    io = FaultyIO()
    ks = keys("part", 8)
    async with offloader(kv, disk_tier_path, cpu_blocks=8, file_io=io) as off:
        await fill(off, kv, ks[:4])
        io.fail_after_bytes = io.written + kv.caches.page_bytes_per_block  # room for one more
        kv.write([4, 5, 6, 7], ks[4:])
        assert (await off.store(ks[4:], [4, 5, 6, 7])).ok
        await off.drain()
        stats = off.statistics()
        tier = stats.tiers[0]
        # One transfer wrote one block and failed three: each block counted once, as the tier does.
        assert (tier.blocks_written, tier.write_failures) == (5, 3)
        assert tier.writes == 2  # counted once, by the tier (the Offloader no longer repeats it)
        assert stats.manager.pinned_blocks == 0


async def test_a_promotion_the_pool_has_no_room_for_is_counted_and_leaks_nothing(
    disk_tier_path: Path,
) -> None:
    kv = KV()
    old, new = keys("old", 4), keys("new", 4)
    async with offloader(kv, disk_tier_path, cpu_blocks=4) as off:
        await fill(off, kv, old)
        await fill(off, kv, new, start=4)  # the pool holds 4: `old` is on disk only
        tier = off.tiers[0]
        assert is_disk_tier(tier) and all(tier.index.holds(k) for k in old)
        lease = off.pin_prefix(new)  # every CPU block pinned: no room to promote into
        assert lease is not None and lease.count == 4
        kv.clear(range(64))
        assert await off.load_prefix(old, [20, 21, 22, 23]) == 0  # the prefix ends there
        stats = off.statistics()
        assert stats.promotions_no_room == 1
        assert stats.tiers[0].reads == 0 and stats.tiers[0].read_failures == 0
        assert stats.manager.pinned_blocks == 4  # the lease's, nothing more
        assert stats.manager.writing_blocks == 0 and stats.writing_keys == 0
        assert stats.loads_in_flight == 0
        assert tier.index.slots.statistics().pinned_blocks == 0
        lease.release()
        # With room again the same load promotes and loads the whole prefix.
        assert await off.load_prefix(old, [20, 21, 22, 23]) == 4
        assert kv.holds([20, 21, 22, 23], old)
        stats = off.statistics()
        assert stats.promotions_no_room == 1 and stats.tiers[0].blocks_read == 4
        assert stats.manager.pinned_blocks == 0 and stats.writing_keys == 0


async def test_refusals_under_write_through_warn_once_naming_the_write_limit(
    disk_tier_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Write-through pins what it writes (up to half the pool by default): a pool sized
    for the stores alone then refuses, and the warning says what the pool needs."""
    kv = KV()
    io = FaultyIO()
    io.write_gate.clear()  # the disk holds every write: its pins stay
    async with offloader(kv, disk_tier_path, cpu_blocks=8, file_io=io) as off:
        caplog.set_level(logging.INFO, logger="aiokvo.offloader")
        first = keys("first", 4)
        kv.write([0, 1, 2, 3], first)
        assert (await off.store(first, [0, 1, 2, 3])).ok  # written through: 4 pinned
        second = keys("second", 5)
        kv.write([4, 5, 6, 7, 8], second)
        result = await off.store(second, [4, 5, 6, 7, 8])  # 4 evictable, 5 needed
        assert result.refused == tuple(second) and not result.failed
        (record,) = [r for r in caplog.records if r.name == "aiokvo.offloader"]
        assert record.levelno == logging.WARNING
        message = record.getMessage()
        assert "CPU pool of 8 blocks" in message
        assert "4 by tier write-through in flight, which may pin up to 4" in message
        assert "(requests in flight x blocks per request) + 4 blocks" in message
        io.write_gate.set()
        await off.drain()
        assert (await off.store(second, [4, 5, 6, 7, 8])).ok  # the pins are gone


async def test_a_promotion_past_its_deadline_is_a_counted_miss_and_holds_nothing_after() -> None:
    """A tier read that hangs past ``io_timeout`` costs the load its tier blocks (a miss,
    counted), never the pool's own: its reservation ends with the read, so the pool stores
    and hits as before (bench_tiers' 13.4% replay was not a leak of this kind)."""
    from aiokvo import Offloader
    from aiokvo.testing.faulty import FaultyStore, FaultyTier

    kv = KV()
    tier = FaultyTier(capacity_blocks=64, io_timeout=0.05)  # the read is held by a gate
    store = tier.store
    assert isinstance(store, FaultyStore)
    old, hot = keys("old", 4), keys("hot", 8)
    async with Offloader(kv.config(8), kv.caches, tiers=[tier]) as off:
        await fill(off, kv, old)
        await fill(off, kv, hot, start=4)  # the pool holds 8: `old` is in the tier only
        store.stall(1)
        before = off.statistics()
        kv.clear(range(64))
        assert await off.load_prefix(old, [20, 21, 22, 23]) == 0  # gave up at the deadline
        stats = off.statistics()
        assert stats.promotion_timeouts == 1
        assert stats.miss_blocks - before.miss_blocks == 4
        assert stats.tiers[0].breaker.state == "closed"  # one timeout trips nothing
        assert stats.manager.writing_blocks == 4  # the read still owns its reservation
        # The pool's other four blocks still hit while the read hangs.
        assert await off.load_prefix(hot[4:], [30, 31, 32, 33]) == 4
        store.release()
        await off.drain()
        stats = off.statistics()
        assert stats.manager.writing_blocks == 0 and stats.writing_keys == 0
        assert stats.manager.pinned_blocks == 0
        # Nothing stays reserved: a store the size of the pool is taken whole.
        fresh = keys("fresh", 8)
        kv.write(list(range(40, 48)), fresh)
        result = await off.store(fresh, list(range(40, 48)))
        assert result.ok and not result.refused
        await off.drain()
        assert off.statistics().stores_refused == 0
