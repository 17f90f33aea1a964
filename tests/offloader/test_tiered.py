"""The Offloader's tier driver (promotion and write-through) through a real disk tier:
its counters agree with the tier's, and a promotion it cannot start leaks nothing."""

from __future__ import annotations

from pathlib import Path

from aiokvo.tiers import DiskTier
from tests.tiers.disk._util import KV, FaultyIO, fill, keys, offloader


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
        assert (stats.tier_writes, stats.tier_write_blocks, stats.tier_write_failures) == (2, 5, 3)
        assert stats.manager.pinned_blocks == 0

