"""A private CPU pool with room after every row (a tier's trailer): the views stay
exactly the KV bytes, both backends copy through them, and the room is never written."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from aiokvo.device.fake import FakeDriver
from aiokvo.errors import ConfigError
from aiokvo.handlers import CpuGpuHandlers, make_cpu_gpu_handlers
from aiokvo.handlers.cuda.pair import make_cuda_handlers
from aiokvo.handlers.host.pair import allocate_cpu_pool
from aiokvo.handlers.pool import padded_row_stride
from aiokvo.layout import CanonicalKVCaches
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

GPU_BLOCKS = 12
CPU_BLOCKS = 5


def caches() -> CanonicalKVCaches:
    """A 4 KiB page (rows of whole pages) and a 48-byte one."""
    gen = torch.Generator().manual_seed(7)
    return CanonicalKVCaches.from_engine([
        torch.randint(-128, 127, (GPU_BLOCKS, 4096), dtype=torch.int8, generator=gen),
        torch.randint(-128, 127, (GPU_BLOCKS, 48), dtype=torch.int8, generator=gen),
    ])  # fmt: skip


@pytest.mark.parametrize(
    ("width", "tail", "stride"),
    [
        (4096, 0, 4096),
        (4096, 64, 8192),  # whole pages stay page-aligned (a disk tier keeps O_DIRECT)
        (1 << 20, 64, (1 << 20) + 4096),
        (48, 64, 128),  # else 64-byte lines
        (100, 64, 192),
        (0, 64, 64),
    ],
)
def test_padded_row_stride(width: int, tail: int, stride: int) -> None:
    assert padded_row_stride(width, tail) == stride


def test_padded_row_stride_refuses_negative_room() -> None:
    with pytest.raises(ConfigError, match="row_tail_bytes"):
        padded_row_stride(4096, -1)


@pytest.mark.parametrize("factor", [1, 2])
def test_allocated_rows_have_zeroed_room_outside_the_views(factor: int) -> None:
    kv = caches()
    pools = allocate_cpu_pool(
        kv, block_size_factor=factor, num_cpu_blocks=CPU_BLOCKS, row_tail_bytes=64
    )
    for tensor, pool in zip(kv.tensors, pools, strict=True):
        width = tensor.page_size_bytes * factor
        assert pool.shape == (CPU_BLOCKS, width)
        assert pool.stride(0) == padded_row_stride(width, 64)
        assert pool.data_ptr() % 4096 == 0
        room = torch.as_strided(pool, (CPU_BLOCKS, 64), (pool.stride(0), 1),
                                pool.storage_offset() + width)  # fmt: skip
        assert not room.any()


def build(backend: str, kv: CanonicalKVCaches, factor: int, fake: FakeDriver | None,
          **options: Any) -> CpuGpuHandlers:  # fmt: skip
    if backend == "host":
        return make_cpu_gpu_handlers(kv, block_size_factor=factor, num_cpu_blocks=CPU_BLOCKS,
                                     **options)  # fmt: skip
    return make_cuda_handlers(kv, block_size_factor=factor, num_cpu_blocks=CPU_BLOCKS,
                              driver=fake, **options)  # fmt: skip


@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize(("backend", "options"), [
    ("host", {}), ("host", {"copy_threads": 2, "split_min_bytes": 0}),
    ("cuda", {"engine": "dma"}), ("cuda", {"engine": "kernel"}),
])  # fmt: skip
async def test_copies_through_padded_rows_never_touch_the_room(
    backend: str, options: dict[str, Any], factor: int
) -> None:
    kv = caches()
    fake = FakeDriver() if backend == "cuda" else None
    original = [t.tensor.clone() for t in kv.tensors]
    pair = build(backend, kv, factor, fake, row_tail_bytes=64, **options)
    try:
        assert pair.row_tail_bytes == 64
        pools = pair.cpu_tensors
        rooms = [
            torch.as_strided(p, (CPU_BLOCKS, 64), (p.stride(0), 1),
                             p.storage_offset() + p.shape[1])
            for p in pools
        ]  # fmt: skip
        for room in rooms:
            room.fill_(0x5A)  # what a tier would keep there
        gpu_ids = [3, 8, 1, 6][: 2 * factor]
        cpu_ids = [4, 0][: len(gpu_ids) // factor]
        spec = GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]), CPULoadStoreSpec(cpu_ids)
        result = await pair.gpu_to_cpu.transfer_async(1, spec)
        assert result.success, result.error
        for t, pool in enumerate(pools):
            page = kv.tensors[t].page_size_bytes
            for k, gpu_block in enumerate(gpu_ids):
                row, sub = cpu_ids[k // factor], k % factor
                got = pool[row, sub * page : (sub + 1) * page]
                assert torch.equal(got, original[t][gpu_block].view(-1).view(torch.int8))
        assert all(bool((room == 0x5A).all()) for room in rooms)  # the room kept its bytes
        for t in kv.tensors:
            t.tensor.zero_()
        back = GPULoadStoreSpec(list(range(len(gpu_ids))), [len(gpu_ids)], [0])
        result = await pair.cpu_to_gpu.transfer_async(2, (CPULoadStoreSpec(cpu_ids), back))
        assert result.success, result.error
        for t in range(len(kv.tensors)):
            for k, gpu_block in enumerate(gpu_ids):
                assert torch.equal(kv.tensors[t].tensor[k], original[t][gpu_block])
            assert not kv.tensors[t].tensor[len(gpu_ids):].any()  # no room byte loaded
    finally:
        await pair.aclose()
        if fake is not None:
            assert fake.registered == {}
            fake.close()


def test_no_room_asked_is_the_unpadded_pool() -> None:
    kv = caches()
    pools = allocate_cpu_pool(kv, block_size_factor=1, num_cpu_blocks=CPU_BLOCKS)
    assert [p.stride(0) for p in pools] == [4096, 48]
    assert all(p.is_contiguous() for p in pools)
    assert np.array_equal(pools[0].numpy(), np.zeros((CPU_BLOCKS, 4096), np.int8))


@pytest.mark.parametrize("backend", ["host", "cuda"])
async def test_a_shared_region_gives_no_room(backend: str, tmp_path: Any) -> None:
    # A region's bytes after a row are another tensor's or rank's: never a tier's.
    import uuid

    from aiokvo.memory.shared_region import SharedOffloadRegion

    kv = caches()
    fake = FakeDriver() if backend == "cuda" else None
    region = SharedOffloadRegion(
        f"room-{uuid.uuid4().hex[:10]}", num_blocks=CPU_BLOCKS, num_workers=1,
        page_bytes_per_rank=kv.page_bytes_per_block, rank=0, directory=tmp_path,
    )  # fmt: skip
    try:
        options: dict[str, Any] = {"region": region, "row_tail_bytes": 64}
        pair = build(backend, kv, 1, fake, **options)
        assert pair.row_tail_bytes == 0
        assert all(t.stride(0) == region.row_stride for t in pair.cpu_tensors)
        await pair.aclose()
        del pair
    finally:
        region.close()
        if fake is not None:
            fake.close()
