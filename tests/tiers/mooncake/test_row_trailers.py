"""A block's trailer in room after its CPU-pool row: one buffer per block each way.

The Mooncake tier asks the Offloader for that room when every block is one
canonical tensor (vLLM's cross-layer layout) and the room is cheap; the
objects are the same bytes as with a separate trailer arena (two buffers), so
either kind of replica reads the other's, and every check still holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiokvo import Offloader
from aiokvo.specs import ReqContext
from aiokvo.testing.mooncake_fake import FakeMooncakeCluster
from aiokvo.tiers import DiskTier, DiskTierConfig, TierBinding
from aiokvo.tiers.disk.store import DiskStore
from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.mooncake.format import TRAILER_BYTES, check_trailer
from tests.offloader._harness import KV, keys
from tests.tiers.disk._util import disk_tier
from tests.tiers.mooncake._support import PagesKV, eventually, fake_tier, mooncake_stats

pytestmark = pytest.mark.usefixtures("aiokvo_leak_check")

PAGE = 256 << 10  # one tensor of 256 KiB rows: the room (a page) is 1/64 of a row
CPU_BLOCKS = 8


@pytest.fixture
def cluster() -> FakeMooncakeCluster:
    return FakeMooncakeCluster()


def one_tensor() -> PagesKV:
    return PagesKV(32, page=PAGE, layers=1)


def replica(tier: Any, kv: PagesKV, *tiers: Any) -> Offloader:
    return Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[*tiers, tier])


async def store_on(off: Offloader, kv: PagesKV, ks: list[Any]) -> None:
    blocks = list(range(len(ks)))
    kv.write(blocks, ks)
    assert len((await off.store(ks, blocks)).stored) == len(ks)
    await off.drain()


@pytest.mark.parametrize(("writer", "reader"), [(True, True), (True, False), (False, True)])
async def test_one_buffer_blocks_round_trip_byte_exact_with_either_kind_of_replica(
    cluster: FakeMooncakeCluster, writer: bool, reader: bool
) -> None:
    ks = keys(*"abcd")
    kv_a, kv_b = one_tensor(), one_tensor()
    tier_a = fake_tier(cluster, row_trailers=writer)
    async with replica(tier_a, kv_a) as a:
        (pool,) = a.spec.cpu_tensors  # type: ignore[attr-defined]
        assert pool.shape[1] == PAGE
        assert pool.stride(0) == (PAGE + 4096 if writer else PAGE)
        await store_on(a, kv_a, ks)
    assert cluster.calls.buffers == [1 if writer else 2] * 4
    layout = tier_a.fingerprint.digest()[:16]
    for k in ks:
        data = cluster.objects[tier_a.store.object_name(k)]
        assert len(data) == PAGE + TRAILER_BYTES
        assert data[:PAGE] == kv_a.page(k, 0).tobytes()  # the row: no room byte in it
        assert check_trailer(data[PAGE:], layout, k, PAGE) is not None
    cluster.calls.buffers.clear()
    async with replica(fake_tier(cluster, row_trailers=reader), kv_b) as b:
        assert await b.load_prefix(ks, [20, 21, 22, 23]) == 4
        assert kv_b.holds([20, 21, 22, 23], ks)
        assert mooncake_stats(b).blocks_read == 4
    assert cluster.calls.buffers == [1 if reader else 2] * 4


@pytest.mark.parametrize("where", ["payload", "trailer"])
async def test_a_corrupt_one_buffer_block_is_a_miss_and_never_reaches_the_engine(
    cluster: FakeMooncakeCluster, where: str
) -> None:
    ks = keys(*"abc")
    kv_a, kv_b = one_tensor(), one_tensor()
    tier_a = fake_tier(cluster)
    async with replica(tier_a, kv_a) as a:
        await store_on(a, kv_a, ks)
    bad = tier_a.store.object_name(ks[1])
    cluster.corrupt(bad, offset=PAGE - 1 if where == "payload" else PAGE + 30)
    async with replica(fake_tier(cluster), kv_b) as b:
        assert await b.load_prefix(ks, [20, 21, 22]) == 1
        assert kv_b.holds([20], ks[:1])
        assert not kv_b.layers[0][21:23].any()
        stats = mooncake_stats(b)
        if where == "payload":
            assert (stats.checksum_failures, stats.bad_trailers) == (1, 0)
        else:
            assert stats.bad_trailers == 1
        await eventually(lambda: bad not in cluster.objects, "the corrupt object's removal")
        assert b.manager.lookup(ks[1], ReqContext()) is False


async def test_blocks_of_several_tensors_keep_the_trailer_arena(
    cluster: FakeMooncakeCluster,
) -> None:
    kv = KV(64)  # two layers: two canonical tensors per block, no room asked
    ks = keys(*"ab")
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[fake_tier(cluster)]) as off:
        assert all(t.is_contiguous() for t in off.spec.cpu_tensors)  # type: ignore[attr-defined]
        blocks = [0, 1]
        kv.write(blocks, ks)
        assert len((await off.store(ks, blocks)).stored) == 2
        await off.drain()
    assert cluster.calls.buffers == [3, 3]


async def test_small_rows_are_not_padded(cluster: FakeMooncakeCluster) -> None:
    kv = PagesKV(32, page=64 << 10, layers=1)  # a page of room would be 1/16 of a row
    async with replica(fake_tier(cluster), kv) as off:
        (pool,) = off.spec.cpu_tensors  # type: ignore[attr-defined]
        assert pool.is_contiguous()
        await store_on(off, kv, keys(*"ab"))
    assert cluster.calls.buffers == [2, 2]


class RoomyDiskTier(StoreTier):
    """A disk tier that asks for room too (first in line), and says what it got."""

    granted: int | None = None

    def __init__(self, root: Path, **settings: Any) -> None:
        config = DiskTierConfig.of(root=str(root), **settings)
        super().__init__(DiskStore(config), config)

    def pool_row_tail_bytes(self, kv_caches: Any, config: Any) -> int:
        return 128

    def bind(self, binding: TierBinding) -> Any:
        self.granted = binding.row_tail_bytes
        return super().bind(binding)


async def test_the_room_is_one_tiers_the_first_that_asks(
    cluster: FakeMooncakeCluster, disk_tier_path: Path
) -> None:
    kv = one_tensor()
    disk = RoomyDiskTier(disk_tier_path, capacity_bytes=64 << 20, model_id="test-model",
                         refresh_interval=0)  # fmt: skip
    async with replica(fake_tier(cluster), kv, disk) as off:
        assert disk.granted == 128
        await store_on(off, kv, keys(*"ab"))
    assert cluster.calls.buffers == [2, 2]  # no room of its own: the arena


async def test_padded_rows_still_go_to_disk_with_o_direct_and_come_back(
    cluster: FakeMooncakeCluster, disk_tier_path: Path
) -> None:
    from tests.tiers.disk._util import KV as DiskKV

    kv = DiskKV(32, page=PAGE, layers=1)
    disk = disk_tier(disk_tier_path, slots=16, kv=kv)
    ks = keys(*"abcdefghijkl")
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches,
                         tiers=[disk, fake_tier(cluster)]) as off:  # fmt: skip
        (pool,) = off.spec.cpu_tensors  # type: ignore[attr-defined]
        assert pool.stride(0) == PAGE + 4096
        for i in range(0, 12, 4):  # the pool holds 8: the first 4 leave it
            blocks = list(range(i, i + 4))
            kv.write(blocks, ks[i : i + 4])
            assert (await off.store(ks[i : i + 4], blocks)).ok
            await off.drain()
        stats = off.statistics()
        assert stats.tiers[0].direct_io and stats.tiers[0].blocks_written == 12
        kv.clear(range(32))
        assert await off.load_prefix(ks[:8], list(range(20, 28))) == 8
        assert kv.holds(range(20, 28), ks[:8])
        assert off.statistics().hits_by_medium["DISK"] == 4
    assert set(cluster.calls.buffers) == {1}


@pytest.mark.parametrize("page", [128 << 10, 3200], ids=["page-room", "line-room"])
async def test_two_gpu_blocks_per_key_keep_the_trailer_in_the_room_next_to_a_disk_tier(
    cluster: FakeMooncakeCluster, disk_tier_path: Path, page: int
) -> None:
    import numpy as np
    import torch

    from aiokvo import CanonicalKVCaches, OffloadConfig

    def pages(k: bytes, sub: int) -> Any:
        seed = int.from_bytes(bytes(k)[:8], "little") ^ sub
        return np.random.default_rng(seed).integers(-128, 128, page, dtype=np.int8)

    def replica_kv() -> tuple[torch.Tensor, CanonicalKVCaches, OffloadConfig]:
        layer = torch.zeros(32, page, dtype=torch.int8)
        caches = CanonicalKVCaches.from_engine([layer])
        config = OffloadConfig(
            gpu_block_sizes=(16,), hash_block_size=16, offloaded_block_size=32,
            kv_bytes_per_block=caches.page_bytes_per_block,
            cpu_bytes_to_use=4 * 2 * caches.page_bytes_per_block,
        )  # fmt: skip
        return layer, caches, config

    def holds(layer: torch.Tensor, blocks: list[int], ks: list[Any]) -> bool:
        return all(
            np.array_equal(layer[b].numpy(), pages(ks[i // 2], i % 2))
            for i, b in enumerate(blocks)
        )

    ks = keys(*"abcdefgh")
    layer, caches, config = replica_kv()
    tier = fake_tier(cluster)
    disk = DiskTier(disk_tier_path, capacity_bytes=32 << 20, model_id="test-model",
                    refresh_interval=0)  # fmt: skip
    async with Offloader(config, caches, tiers=[disk, tier]) as a:
        (pool,) = a.spec.cpu_tensors  # type: ignore[attr-defined]
        width = 2 * page
        assert pool.shape[1] == width and pool.stride(0) - width >= TRAILER_BYTES
        for lo in (0, 4):  # the pool holds 4 keys: the first four leave it
            blocks = list(range(2 * lo, 2 * lo + 8))
            for i, b in enumerate(blocks):
                layer[b].numpy()[:] = pages(ks[lo + i // 2], i % 2)
            assert (await a.store(ks[lo : lo + 4], blocks)).ok
            await a.drain()
        stats = a.statistics()
        assert stats.tiers[0].direct_io is (page % 4096 == 0)
        layer.zero_()
        assert await a.load_prefix(ks[:4], list(range(16, 24))) == 4  # from disk
        assert holds(layer, list(range(16, 24)), ks[:4])
        assert not layer[:16].any() and not layer[24:].any()
        assert a.statistics().hits_by_medium["DISK"] == 4
    assert set(cluster.calls.buffers) == {1}
    layout = tier.fingerprint.digest()[:16]
    for k in ks:
        data = cluster.objects[tier.store.object_name(k)]
        assert data[:page] == pages(k, 0).tobytes() and data[page:width] == pages(k, 1).tobytes()
        assert check_trailer(data[width:], layout, k, width) is not None
    layer_b, caches_b, config_b = replica_kv()
    async with Offloader(config_b, caches_b, tiers=[fake_tier(cluster)]) as b:
        assert await b.load_prefix(ks[2:6], list(range(8, 16))) == 4  # from Mooncake
        assert holds(layer_b, list(range(8, 16)), ks[2:6])
        assert not layer_b[:8].any() and not layer_b[16:].any()
        assert mooncake_stats(b).blocks_read == 4


async def test_pipelined_one_buffer_blocks_fail_alone_and_keep_their_neighbours_trailers(
    cluster: FakeMooncakeCluster,
) -> None:
    ks = keys(*"abcdefgh")
    kv_a, kv_b = one_tensor(), one_tensor()
    chunked = {"pipeline_bytes": 2 * PAGE, "checksum_threads": 2}  # two blocks per call
    tier_a = fake_tier(cluster, **chunked)
    async with replica(tier_a, kv_a) as a:
        await store_on(a, kv_a, ks[:4])
        await store_on(a, kv_a, ks[4:])
    assert cluster.calls.put == 4 and set(cluster.calls.buffers) == {1}
    cluster.corrupt(tier_a.store.object_name(ks[2]), offset=PAGE + 5)  # its trailer
    tier_b = fake_tier(cluster, **chunked)
    async with replica(tier_b, kv_b) as b:
        cluster.codes[tier_b.store.object_name(ks[5])] = -704  # gone meanwhile
        gets = cluster.calls.get
        assert await b.load_prefix(ks, list(range(20, 28))) == 2
        assert cluster.calls.get - gets == 4
        assert kv_b.holds([20, 21], ks[:2]) and not kv_b.layers[0][22:28].any()
        stats = mooncake_stats(b)
        assert (stats.blocks_read, stats.bad_trailers, stats.read_failures) == (6, 1, 2)
        # The good blocks after the bad ones were promoted, each with its own bytes.
        good = [ks[i] for i in (3, 4, 6, 7)]
        kv_b.layers[0].zero_()
        gets = cluster.calls.get
        assert await b.load_prefix(good[:2], [10, 11]) == 2
        assert await b.load_prefix(good[2:], [12, 13]) == 2
        assert kv_b.holds([10, 11, 12, 13], good) and cluster.calls.get == gets
