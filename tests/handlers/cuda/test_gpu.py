"""The CUDA backend on a real device (skipped cleanly without one).

Run on a GPU box by ``scripts/gpu_check.sh``. Every test checks bytes, not
just success flags: KV tensors are random, and the CPU pool is compared
with the exact GPU pages each spec names.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import torch

from aiokvo.device.driver import RuntimeDriver, load_driver
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler
from aiokvo.handlers.cuda.kernel import get_copy_kernel
from aiokvo.handlers.cuda.pair import make_cuda_handlers
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.poller import EventPoller
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

pytestmark = pytest.mark.gpu

ENGINES = ["dma", "kernel"]


@pytest.fixture(scope="module")
def driver() -> RuntimeDriver:
    return load_driver(0)


def random_kv(num_layers: int, num_blocks: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(7)
    return [
        torch.randn((num_blocks, *shape), device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(num_layers)
    ]


def rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int8).reshape(tensor.shape[0], -1)


def test_the_copy_kernel_compiles_for_this_device(driver: RuntimeDriver) -> None:
    assert get_copy_kernel(driver) is get_copy_kernel(driver)
    major = torch.cuda.get_device_capability(0)[0]
    assert driver.device_arch().startswith(str(major))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factor", [1, 3])
async def test_round_trip_is_byte_exact(driver: RuntimeDriver, engine: str, factor: int) -> None:
    kv = random_kv(4, 32, (16, 8, 8))  # 2 KiB pages
    caches = CanonicalKVCaches.from_block_tensors([kv])
    async with make_cuda_handlers(
        caches, block_size_factor=factor, num_cpu_blocks=8, driver=driver, engine=engine
    ) as pair:
        gpu_ids = [5, 9, 2, 30, 17, 11][: 2 * factor]
        cpu_ids = [6, 1]
        result = await pair.gpu_to_cpu.transfer_async(
            1, (GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]), CPULoadStoreSpec(cpu_ids))
        )
        assert result.success, result.error
        assert result.transfer_time is not None and result.transfer_time > 0
        for layer, cpu in zip(kv, pair.cpu_tensors, strict=True):
            expected = rows(layer)[gpu_ids].cpu().reshape(2, -1)
            assert torch.equal(cpu[cpu_ids], expected)
        saved = [rows(layer)[gpu_ids].clone() for layer in kv]
        for layer in kv:
            rows(layer)[gpu_ids] = 0
        torch.cuda.synchronize()  # loads do not wait for torch's stream; stores do
        result = await pair.cpu_to_gpu.transfer_async(
            2, (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]))
        )
        assert result.success, result.error
        torch.cuda.synchronize()
        for layer, before in zip(kv, saved, strict=True):
            assert torch.equal(rows(layer)[gpu_ids], before)
        handler = pair.gpu_to_cpu
        assert isinstance(handler, CudaOffloadingHandler)
        assert handler.engine_counts[engine] == 1  # type: ignore[index]


@pytest.mark.parametrize("engine", ENGINES)
async def test_partial_first_block_and_three_groups_one_empty(
    driver: RuntimeDriver, engine: str
) -> None:
    kv = random_kv(3, 24, (16, 4, 16))
    caches = CanonicalKVCaches.from_block_tensors([[kv[0]], [kv[1]], [kv[2]]])
    async with make_cuda_handlers(
        caches, block_size_factor=2, num_cpu_blocks=6, driver=driver, engine=engine
    ) as pair:
        # group 0: 3 GPU blocks from logical index 1 (skip one sub-block) -> CPU 4 (sub 1), 2;
        # group 1: empty; group 2: 2 GPU blocks aligned -> CPU 0.
        spec = (
            GPULoadStoreSpec([3, 4, 5, 20, 21], [3, 0, 2], [1, 0, 0]),
            CPULoadStoreSpec([4, 2, 0]),
        )
        result = await pair.gpu_to_cpu.transfer_async(1, spec)
        assert result.success, result.error
        page = rows(kv[0]).shape[1]
        cpu0, cpu1, cpu2 = pair.cpu_tensors
        g0 = rows(kv[0]).cpu()
        assert torch.equal(cpu0[4, page:], g0[3])
        assert torch.equal(cpu0[2, :page], g0[4])
        assert torch.equal(cpu0[2, page:], g0[5])
        assert torch.equal(cpu2[0], rows(kv[2])[[20, 21]].cpu().reshape(-1))
        assert not cpu1.any()  # the empty group moved nothing


@pytest.mark.parametrize("engine", ENGINES)
async def test_store_sees_data_a_racing_kernel_writes(driver: RuntimeDriver, engine: str) -> None:
    kv = [torch.zeros((16, 4096), dtype=torch.int8, device="cuda") for _ in range(2)]
    caches = CanonicalKVCaches.from_block_tensors([kv])
    async with make_cuda_handlers(
        caches, block_size_factor=1, num_cpu_blocks=4, driver=driver, engine=engine
    ) as pair:
        torch.cuda.synchronize()
        # On torch's current stream: spin ~50 ms, then write the KV data.
        torch.cuda._sleep(100_000_000)
        for layer in kv:
            layer[3].fill_(42)
        task = pair.gpu_to_cpu.transfer_async(
            1, (GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([2]))
        )
        result = await task
        assert result.success, result.error
        for cpu in pair.cpu_tensors:
            assert torch.all(cpu[2] == 42)


async def test_store_waits_for_a_producer_stream_passed_in(driver: RuntimeDriver) -> None:
    kv = [torch.zeros((8, 8192), dtype=torch.int8, device="cuda")]
    caches = CanonicalKVCaches.from_block_tensors([kv])
    producer = torch.cuda.Stream()
    async with make_cuda_handlers(
        caches,
        block_size_factor=1,
        num_cpu_blocks=2,
        driver=driver,
        producer_stream=lambda: producer.cuda_stream,
    ) as pair:
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(100_000_000)
            kv[0][1].fill_(-5)
        result = await pair.gpu_to_cpu.transfer_async(
            1, (GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))
        )
        assert result.success, result.error
        assert torch.all(pair.cpu_tensors[0][0] == -5)


async def test_load_waits_for_the_current_stream_zeroing_its_blocks(driver: RuntimeDriver) -> None:
    # vLLM zeroes new blocks on its compute stream, then submits the load: the
    # load must land after the zeroing, or the zeros overwrite it.
    kv = [torch.zeros((8, 8192), dtype=torch.int8, device="cuda")]
    caches = CanonicalKVCaches.from_block_tensors([kv])
    async with make_cuda_handlers(
        caches, block_size_factor=1, num_cpu_blocks=2, driver=driver
    ) as pair:
        pair.cpu_tensors[0][1].fill_(7)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms on torch's current stream, then zero
        kv[0][4].zero_()
        result = await pair.cpu_to_gpu.transfer_async(
            1, (CPULoadStoreSpec([1]), GPULoadStoreSpec([4], [1], [0]))
        )
        assert result.success, result.error
        torch.cuda.synchronize()
        assert torch.all(kv[0][4] == 7)


@pytest.mark.parametrize("engine", ENGINES)
async def test_shared_region_registered_as_pinned(driver: RuntimeDriver, engine: str) -> None:
    from aiokvo.memory.shared_region import SharedOffloadRegion

    kv = random_kv(2, 16, (16, 8, 16))  # 4 KiB pages
    page = rows(kv[0]).shape[1]
    region = SharedOffloadRegion(
        f"gpucheck{os.getpid()}{engine}",
        num_blocks=8,
        num_workers=2,
        page_bytes_per_rank=2 * page,
        rank=1,  # in /dev/shm, as in production: pinning file-backed pages may be refused
    )
    try:
        region.pin(driver=driver)
        views = [region.create_next_view(page) for _ in kv]
        handler = CudaOffloadingHandler(
            CanonicalKVCaches.from_block_tensors([kv]),
            views,
            block_size_factor=1,
            gpu_to_cpu=True,
            driver=driver,
            engine=engine,
        )
        async with handler:
            result = await handler.transfer_async(
                1, (GPULoadStoreSpec([4, 7], [2], [0]), CPULoadStoreSpec([5, 0]))
            )
            assert result.success, result.error
        for i, layer in enumerate(kv):
            assert torch.equal(views[i][[5, 0]], rows(layer)[[4, 7]].cpu())
        del views, handler
    finally:
        region.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_make_cuda_handlers_over_a_shared_region_with_factor_two(
    driver: RuntimeDriver, engine: str
) -> None:
    """The region as the pool: strided rows (rank 1 of 2) holding two pages each."""
    from aiokvo.memory.shared_region import SharedOffloadRegion

    kv = random_kv(2, 16, (16, 8, 8))  # 2 KiB pages
    caches = CanonicalKVCaches.from_block_tensors([kv])
    region = SharedOffloadRegion(
        f"gpupool{os.getpid()}{engine}",
        num_blocks=4,
        num_workers=2,
        page_bytes_per_rank=caches.page_bytes_per_block * 2,
        rank=1,
    )
    try:
        pair = make_cuda_handlers(
            caches, block_size_factor=2, num_cpu_blocks=4, region=region, driver=driver,
            engine=engine,
        )  # fmt: skip
        assert region.is_pinned
        async with pair:
            gpu_ids, cpu_ids = [3, 8, 1, 12], [2, 0]
            spec = GPULoadStoreSpec(gpu_ids, [4], [0]), CPULoadStoreSpec(cpu_ids)
            result = await pair.gpu_to_cpu.transfer_async(1, spec)
            assert result.success, result.error
            for layer, cpu in zip(kv, pair.cpu_tensors, strict=True):
                assert cpu.stride(0) == region.row_stride
                expected = rows(layer)[gpu_ids].cpu().reshape(2, -1)
                assert torch.equal(cpu[cpu_ids], expected)
            assert not region.rows()[:, : region.page_bytes_per_rank].any()  # rank 0's half
            saved = [rows(layer)[gpu_ids].clone() for layer in kv]
            for layer in kv:
                rows(layer)[gpu_ids] = 0
            torch.cuda.synchronize()
            back = CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids, [4], [0])
            result = await pair.cpu_to_gpu.transfer_async(2, back)
            assert result.success, result.error
            for layer, before in zip(kv, saved, strict=True):
                assert torch.equal(rows(layer)[gpu_ids], before)
        del pair, cpu  # the views: the region can then unmap at once
    finally:
        region.close()


async def test_awaited_result_arrives_through_the_thread_poller(driver: RuntimeDriver) -> None:
    kv = random_kv(1, 8, (16, 8, 128))
    caches = CanonicalKVCaches.from_block_tensors([kv])
    async with make_cuda_handlers(
        caches, block_size_factor=1, num_cpu_blocks=4, driver=driver
    ) as pair:
        handler = pair.gpu_to_cpu
        assert isinstance(handler, CudaOffloadingHandler)
        assert handler.poller_mode == "thread"
        tasks = [
            handler.transfer_async(i, (GPULoadStoreSpec([i], [1], [0]), CPULoadStoreSpec([i])))
            for i in range(4)
        ]
        results = await asyncio.gather(*(asyncio.ensure_future(t) for t in tasks))  # type: ignore[arg-type]
        assert [r.job_id for r in results] == [0, 1, 2, 3]
        assert all(r.success for r in results)
        poller = EventPoller.existing(asyncio.get_running_loop())
        assert poller is not None
        finished = handler.get_finished_nowait()
        assert [r.job_id for r in finished] == [0, 1, 2, 3]
        assert torch.equal(pair.cpu_tensors[0], rows(kv[0])[:4].cpu())


def test_batched_dma_availability_is_reported(driver: RuntimeDriver) -> None:
    print(
        f"driver {driver.driver_version} runtime {driver.runtime_version} "
        f"batch={driver.has_memcpy_batch()} arch=sm_{driver.device_arch()}"
    )
    expected = min(driver.driver_version, driver.runtime_version) >= 12080
    assert driver.has_memcpy_batch() in (expected, False)


@pytest.fixture
def loop_driver(driver: RuntimeDriver) -> Iterator[RuntimeDriver]:
    """The real driver with batching switched off, to cover the cudaMemcpyAsync loop."""
    saved = driver._batch_ok
    driver._batch_ok = False
    yield driver
    driver._batch_ok = saved


async def test_memcpy_loop_fallback_round_trip(loop_driver: RuntimeDriver) -> None:
    kv = random_kv(2, 8, (16, 8, 16))
    caches = CanonicalKVCaches.from_block_tensors([kv])
    async with make_cuda_handlers(
        caches, block_size_factor=1, num_cpu_blocks=4, driver=loop_driver, engine="dma"
    ) as pair:
        result = await pair.gpu_to_cpu.transfer_async(
            1, (GPULoadStoreSpec([6, 1], [2], [0]), CPULoadStoreSpec([3, 0]))
        )
        assert result.success, result.error
        for layer, cpu in zip(kv, pair.cpu_tensors, strict=True):
            assert torch.equal(cpu[[3, 0]], rows(layer)[[6, 1]].cpu())


async def test_the_generic_pair_factory_picks_cuda_for_cuda_tensors() -> None:
    from aiokvo.handlers import make_cpu_gpu_handlers

    kv = random_kv(2, 8, (16, 8, 16))
    caches = CanonicalKVCaches.from_block_tensors([kv])
    async with make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=4) as pair:
        assert isinstance(pair.gpu_to_cpu, CudaOffloadingHandler)
        assert isinstance(pair.cpu_to_gpu, CudaOffloadingHandler)
        result = await pair.gpu_to_cpu.transfer_async(
            1, (GPULoadStoreSpec([7], [1], [0]), CPULoadStoreSpec([3]))
        )
        assert result.success, result.error
        assert torch.equal(pair.cpu_tensors[1][3], rows(kv[1])[7].cpu())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factor", [1, 2])
async def test_padded_pinned_pool_round_trip_leaves_the_room_alone(
    driver: RuntimeDriver, engine: str, factor: int
) -> None:
    """Rows with room after them (a tier's trailer): the real engines copy only the views."""
    kv = random_kv(2, 16, (16, 8, 16))  # 4 KiB pages: padded rows stay page-aligned
    caches = CanonicalKVCaches.from_block_tensors([kv])
    async with make_cuda_handlers(
        caches, block_size_factor=factor, num_cpu_blocks=4, driver=driver, engine=engine,
        row_tail_bytes=64,
    ) as pair:  # fmt: skip
        assert pair.row_tail_bytes == 64
        rooms = [
            torch.as_strided(p, (4, 64), (p.stride(0), 1), p.storage_offset() + p.shape[1])
            for p in pair.cpu_tensors
        ]
        for room in rooms:
            room.fill_(0x5A)
        gpu_ids = [9, 2, 14, 5][: 2 * factor]
        cpu_ids = [3, 1][: len(gpu_ids) // factor]
        spec = GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]), CPULoadStoreSpec(cpu_ids)
        result = await pair.gpu_to_cpu.transfer_async(1, spec)
        assert result.success, result.error
        for layer, cpu in zip(kv, pair.cpu_tensors, strict=True):
            expected = rows(layer)[gpu_ids].cpu().reshape(len(cpu_ids), -1)
            assert torch.equal(cpu[cpu_ids], expected)
        assert all(bool((room == 0x5A).all()) for room in rooms)
        saved = [rows(layer)[gpu_ids].clone() for layer in kv]
        for layer in kv:
            rows(layer).zero_()
        torch.cuda.synchronize()
        back = CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0])
        result = await pair.cpu_to_gpu.transfer_async(2, back)
        assert result.success, result.error
        torch.cuda.synchronize()
        for layer, before in zip(kv, saved, strict=True):
            assert torch.equal(rows(layer)[gpu_ids], before)
            others = [i for i in range(16) if i not in gpu_ids]
            assert not rows(layer)[others].any()  # no room byte landed on the GPU
        del rooms
