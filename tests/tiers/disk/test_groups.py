"""The disk tier under a layout of several KV groups: each block back into its own group."""

from __future__ import annotations

from pathlib import Path

from aiokvo import GPULoadStoreSpec, Offloader
from aiokvo.tiers import DiskTier
from tests.offloader._harness import KV, keys


async def test_two_kv_groups_promote_from_disk_into_their_own_tensors(
    disk_tier_path: Path,
) -> None:
    kv = KV(32, groups=2)
    tier = DiskTier(disk_tier_path, capacity_bytes=1 << 20, model_id="m", refresh_interval=0)
    async with Offloader(kv.config(6), kv.caches, tiers=[tier]) as off:
        g0 = keys("a", "b", "c", "d", group=0)
        g1 = keys("a", "b", "c", "d", group=1)  # the same hashes, another group
        kv.write([0, 1, 2, 3], g0, group=0)
        kv.write([4, 5, 6, 7], g1, group=1)
        assert (await off.store(g0, GPULoadStoreSpec([0, 1, 2, 3], [4, 0], [0, 0]))).ok
        await off.drain()
        assert (await off.store(g1, GPULoadStoreSpec([4, 5, 6, 7], [0, 4], [0, 0]))).ok
        await off.drain()  # the pool holds 6: group 0's first two live on disk only
        assert off.manager.block_status(g0[0]) is None
        assert off.statistics().tiers[0].blocks_written == 8
        for group in kv.layers:
            for tensor in group:
                tensor.zero_()
        dst = GPULoadStoreSpec([10, 11, 12, 20, 21, 22], [3, 3], [0, 0])
        assert await off.load_prefix(g0[:3] + g1[:3], dst) == 3
        assert kv.holds([10, 11, 12], g0[:3], group=0)
        assert kv.holds([20, 21, 22], g1[:3], group=1)
        stats = off.statistics()
        assert stats.hits_by_medium["DISK"] == 2 and stats.tiers[0].blocks_read == 2
        assert stats.manager.pinned_blocks == 0 and stats.manager.writing_blocks == 0
