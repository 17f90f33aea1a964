"""A shared region as the CPU pool: both backends copy to and from its strided row views.

Two ranks map one region here (two region objects in one process, as two
worker processes would; tests/test_offloading_spec.py runs real processes).
Each rank's views have a row stride spanning every tensor and every rank, so
with ``block_size_factor > 1`` a row's pages are not evenly spaced.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aiokvo.device.fake import FakeDriver
from aiokvo.errors import ConfigError, SharedRegionLayoutError
from aiokvo.handlers import CpuGpuHandlers, make_cpu_gpu_handlers
from aiokvo.handlers.cuda.pair import make_cuda_handlers
from aiokvo.handlers.host import HostOffloadingHandler
from aiokvo.layout import CanonicalKVCaches
from aiokvo.memory.shared_region import SharedOffloadRegion
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

pytestmark = pytest.mark.filterwarnings("error::ResourceWarning")  # views must not outlive

GPU_BLOCKS = 16
CPU_BLOCKS = 6
WORKERS = 2


def kv_caches(rank: int) -> CanonicalKVCaches:
    """Three layers with 48-, 10- and 64-byte pages (so views start at odd offsets)."""
    gen = torch.Generator().manual_seed(100 + rank)
    layers = [
        torch.randn((GPU_BLOCKS, 3, 8), generator=gen).to(torch.bfloat16),
        torch.randn((GPU_BLOCKS, 5), generator=gen).to(torch.bfloat16),
        torch.randint(-128, 127, (GPU_BLOCKS, 64), dtype=torch.int8, generator=gen),
    ]
    return CanonicalKVCaches.from_engine(layers)


def gpu_page(caches: CanonicalKVCaches, t: int, block: int) -> bytes:
    return caches.tensors[t].tensor[block].numpy().tobytes()


def expected_rows(
    caches: CanonicalKVCaches,
    rank: int,
    factor: int,
    gpu_ids: list[int],
    skip: int,
    cpu_ids: list[int],
    into: np.ndarray,
) -> None:
    """Write where rank ``rank``'s pages must land in the region's raw rows."""
    pbr = caches.page_bytes_per_block * factor
    offset = rank * pbr
    for t, tensor in enumerate(caches.tensors):
        page = tensor.page_size_bytes
        for k, gpu_block in enumerate(gpu_ids):
            sub = skip + k
            row, j = cpu_ids[sub // factor], sub % factor
            start = offset + j * page
            into[row, start : start + page] = np.frombuffer(gpu_page(caches, t, gpu_block), np.int8)
        offset += page * factor


@pytest.fixture
def iid(tmp_path: Path) -> Iterator[str]:
    yield f"pool-{uuid.uuid4().hex[:10]}"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("aiokvo_offload_")] == []


def open_ranks(iid: str, directory: Path, factor: int) -> list[SharedOffloadRegion]:
    pbr = kv_caches(0).page_bytes_per_block * factor
    return [
        SharedOffloadRegion(
            iid,
            num_blocks=CPU_BLOCKS,
            num_workers=WORKERS,
            page_bytes_per_rank=pbr,
            rank=rank,
            directory=directory,
        )
        for rank in range(WORKERS)
    ]


def build(backend: str, caches: CanonicalKVCaches, region: SharedOffloadRegion, factor: int,
          fake: FakeDriver | None, options: dict[str, Any]) -> CpuGpuHandlers:  # fmt: skip
    if backend == "host":
        return make_cpu_gpu_handlers(
            caches, block_size_factor=factor, num_cpu_blocks=CPU_BLOCKS, region=region, **options
        )
    return make_cuda_handlers(
        caches,
        block_size_factor=factor,
        num_cpu_blocks=CPU_BLOCKS,
        region=region,
        driver=fake,
        **options,
    )


CASES = [
    ("host", {}),
    ("host", {"copy_threads": 2, "split_min_bytes": 0}),  # int64 words where aligned
    ("cuda", {"engine": "dma"}),
    ("cuda", {"engine": "kernel"}),
]


@pytest.mark.parametrize("factor", [1, 2, 3])
@pytest.mark.parametrize(("backend", "options"), CASES)
async def test_two_ranks_round_trip_through_one_region_without_touching_each_other(
    iid: str, tmp_path: Path, factor: int, backend: str, options: dict[str, Any]
) -> None:
    fake = FakeDriver() if backend == "cuda" else None
    regions = open_ranks(iid, tmp_path, factor)
    caches = [kv_caches(rank) for rank in range(WORKERS)]
    originals = [
        {(t, b): gpu_page(c, t, b) for t in range(3) for b in range(GPU_BLOCKS)} for c in caches
    ]
    skip = 1 if factor > 1 else 0  # the request's first block is not aligned to an offloaded one
    gpu_ids = [3, 9, 1, 7, 0][: 2 * factor + 1 - skip]
    cpu_ids = [4, 0, 2][: -(-(len(gpu_ids) + skip) // factor)]
    want = np.zeros((CPU_BLOCKS, regions[0].row_stride), dtype=np.int8)
    try:
        pairs = [
            build(backend, caches[r], regions[r], factor, fake, options) for r in range(WORKERS)
        ]
        for r, pair in enumerate(pairs):
            views = pair.cpu_tensors
            assert all(v.stride(0) == regions[r].row_stride for v in views)
            gpu = GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [skip])
            result = await pair.gpu_to_cpu.transfer_async(r, (gpu, CPULoadStoreSpec(cpu_ids)))
            assert result.success, result.error
            expected_rows(caches[r], r, factor, gpu_ids, skip, cpu_ids, want)
            # Every byte of the region: this rank's pages, the other rank's (or
            # zeros, before it stored), nothing else written.
            assert np.array_equal(regions[r].rows().numpy(), want)

        for r, pair in enumerate(pairs):
            for tensor in caches[r].tensors:
                tensor.tensor.zero_()
            back = GPULoadStoreSpec(list(range(10, 10 + len(gpu_ids))), [len(gpu_ids)], [skip])
            result = await pair.cpu_to_gpu.transfer_async(9, (CPULoadStoreSpec(cpu_ids), back))
            assert result.success, result.error
            for t in range(3):
                for k, gpu_block in enumerate(gpu_ids):
                    assert gpu_page(caches[r], t, 10 + k) == originals[r][(t, gpu_block)]
                assert not caches[r].tensors[t].tensor[:10].any()  # nothing else loaded
        assert np.array_equal(regions[0].rows().numpy(), want)  # loads write no CPU byte

        if fake is not None:
            assert all(r.is_pinned for r in regions)
            assert len(fake.registered) == WORKERS  # each rank pinned its mapping once
        for pair in pairs:
            await pair.aclose()
            assert pair.cpu_tensors == () and pair.region is not None
        del pairs, views
    finally:
        for region in reversed(regions):
            region.close()  # no ResourceWarning: the pairs dropped every view
        if fake is not None:
            assert fake.registered == {}
            fake.close()


async def test_a_strided_pool_without_a_region_works_too() -> None:
    caches = kv_caches(0)
    widths = [t.page_size_bytes * 2 for t in caches.tensors]
    backing = torch.zeros((CPU_BLOCKS, sum(widths) + 5), dtype=torch.int8)  # padded rows
    starts = np.cumsum([0, *widths])
    pools = [backing[:, s : s + w] for s, w in zip(starts, widths, strict=False)]
    async with HostOffloadingHandler(caches, pools, block_size_factor=2, gpu_to_cpu=True) as store:
        spec = GPULoadStoreSpec([5, 6, 2], [3], [0]), CPULoadStoreSpec([1, 4])
        assert (await store.transfer_async(1, spec)).success
    page = caches.tensors[1].page_size_bytes
    assert pools[1][4, :page].numpy().tobytes() == gpu_page(caches, 1, 2)
    assert not pools[1][4, page:].any() and not backing[:, -5:].any()


def test_region_pool_checks_the_region_before_taking_views(iid: str, tmp_path: Path) -> None:
    caches = kv_caches(0)
    need = caches.page_bytes_per_block

    def make(**overrides: Any) -> SharedOffloadRegion:
        kwargs: dict[str, Any] = {
            "num_blocks": CPU_BLOCKS, "num_workers": 1, "page_bytes_per_rank": need,
            "rank": 0, "directory": tmp_path,
        }  # fmt: skip
        kwargs.update(overrides)
        return SharedOffloadRegion(iid, **kwargs)

    def pool(region: object, num_cpu_blocks: int = CPU_BLOCKS) -> None:
        make_cpu_gpu_handlers(
            caches, block_size_factor=1, num_cpu_blocks=num_cpu_blocks, region=region
        )

    with make() as region:
        with pytest.raises(ConfigError, match=r"num_cpu_blocks=5 but region .* has 6 rows"):
            pool(region, 5)
        with pytest.raises(ConfigError, match="must be a SharedOffloadRegion"):
            pool(object())
        with pytest.raises(SharedRegionLayoutError, match=f"need {2 * need} bytes"):
            make_cpu_gpu_handlers(
                caches, block_size_factor=2, num_cpu_blocks=CPU_BLOCKS, region=region
            )
        assert region.create_next_view(need).storage_offset() == 0  # no view was taken
    with make(rank=None) as whole, pytest.raises(ConfigError, match="without a rank"):
        pool(whole)
    closed = make()
    closed.close()
    with pytest.raises(ConfigError, match="is closed"):
        pool(closed)
