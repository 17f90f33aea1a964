"""The CUDA handler's logic on the CPU: FakeDriver stands in for the GPU.

"GPU" tensors are plain CPU tensors here; the fake runs each stream on a
thread and copies with memmove, so ordering, pooling, lifetimes and error
paths are exercised exactly as the real driver would drive them.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from aiokvo.device.fake import FakeDriver
from aiokvo.errors import ConfigError, CudaError, TransferSpecError
from aiokvo.handlers import CpuGpuHandlers
from aiokvo.handlers.cuda.engines import choose_engine, coalesce
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler
from aiokvo.handlers.cuda.kernel import COPY_KERNEL_NAME, COPY_KERNEL_SOURCE, get_copy_kernel
from aiokvo.handlers.cuda.pair import make_cuda_handlers
from aiokvo.layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from aiokvo.memory.pinned import HostRegistration, PinnedHostTensor
from aiokvo.memory.shared_region import SharedOffloadRegion
from aiokvo.plan import PointerPlan
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

PAGE = 256
GPU_BLOCKS = 12
CPU_BLOCKS = 8


def canonical(
    tensors: list[torch.Tensor], refs: list[list[CanonicalKVCacheRef]]
) -> CanonicalKVCaches:
    """Row tensors (whole rows are pages) and their group refs as KV caches."""
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, int(t.shape[1])) for t in tensors], refs)


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    driver = FakeDriver()
    yield driver
    driver.close()


class Rig:
    """Two canonical tensors (K, V) on both sides and the pinned CPU side."""

    def __init__(self, driver: FakeDriver, factor: int = 1, groups: int = 1) -> None:
        self.driver = driver
        self.factor = factor
        gen = torch.Generator().manual_seed(1234)
        self.gpu = [
            torch.randint(-128, 127, (GPU_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
            for _ in range(2)
        ]
        self.pinned = [PinnedHostTensor(CPU_BLOCKS, PAGE * factor, driver=driver) for _ in range(2)]
        self.cpu = [p.tensor for p in self.pinned]
        for t in self.cpu:
            t.zero_()
        # Every group reads both tensors (as a hybrid model's groups might).
        self.refs = [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]] * groups

    def handler(self, gpu_to_cpu: bool, **options: object) -> CudaOffloadingHandler:
        return CudaOffloadingHandler(
            canonical(self.gpu, self.refs),
            self.cpu,
            block_size_factor=self.factor,
            gpu_to_cpu=gpu_to_cpu,
            driver=self.driver,
            **options,  # type: ignore[arg-type]
        )

    def cpu_page(self, tensor: int, cpu_block: int, sub: int) -> torch.Tensor:
        return self.cpu[tensor][cpu_block, sub * PAGE : (sub + 1) * PAGE]

    def close(self) -> None:
        for p in self.pinned:
            p.close()


@pytest.fixture
def rig(fake: FakeDriver) -> Iterator[Rig]:
    r = Rig(fake)
    yield r
    r.close()


def store(gpu_ids: list[int], cpu_ids: list[int], sizes: list[int] | None = None,
          indices: list[int] | None = None) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    sizes = sizes if sizes is not None else [len(gpu_ids)]
    indices = indices if indices is not None else [0] * len(sizes)
    return GPULoadStoreSpec(gpu_ids, sizes, indices), CPULoadStoreSpec(cpu_ids)


def load(cpu_ids: list[int], gpu_ids: list[int], sizes: list[int] | None = None,
         indices: list[int] | None = None) -> tuple[CPULoadStoreSpec, GPULoadStoreSpec]:
    gpu_spec, cpu_spec = store(gpu_ids, cpu_ids, sizes, indices)
    return cpu_spec, gpu_spec


@pytest.fixture
async def handlers(rig: Rig) -> AsyncIterator[tuple[CudaOffloadingHandler, CudaOffloadingHandler]]:
    out, back = rig.handler(True), rig.handler(False)
    yield out, back
    await out.aclose()
    await back.aclose()


# --------------------------------------------------------------------- round trips


@pytest.mark.parametrize("engine", ["dma", "kernel"])
@pytest.mark.both_loops
async def test_round_trip_is_byte_exact_for_both_engines(rig: Rig, engine: str) -> None:
    async with rig.handler(True, engine=engine) as out, rig.handler(False, engine=engine) as back:
        result = await out.transfer_async(1, store([3, 7, 1], [5, 0, 2]))
        assert result.success, result.error
        assert result.transfer_size == 3 * 2 * PAGE
        assert result.transfer_type == ("GPU", "CPU")
        for t in range(2):
            for gpu_id, cpu_id in ((3, 5), (7, 0), (1, 2)):
                assert torch.equal(rig.cpu[t][cpu_id], rig.gpu[t][gpu_id])
        expected = [g.clone() for g in rig.gpu]
        for g in rig.gpu:
            g[[9, 10, 11]] = 0
        result = await back.transfer_async(2, load([5, 0, 2], [9, 10, 11]))
        assert result.success, result.error
        for t in range(2):
            assert torch.equal(rig.gpu[t][[9, 10, 11]], expected[t][[3, 7, 1]])
        assert out.engine_counts[engine] == 1 and back.engine_counts[engine] == 1


async def test_factor_three_with_partial_first_block_and_an_empty_group(fake: FakeDriver) -> None:
    rig = Rig(fake, factor=3, groups=3)
    try:
        async with rig.handler(True) as out:
            # group 0: 4 GPU blocks starting at logical index 1 -> skip 1 sub-block,
            # covering CPU blocks 6 (subs 1, 2) and 4 (subs 0, 1); group 1: empty;
            # group 2: 2 GPU blocks aligned at index 3 -> CPU block 1 (subs 0, 1).
            spec = store([0, 1, 2, 3, 8, 9], [6, 4, 1], sizes=[4, 0, 2], indices=[1, 0, 3])
            result = await out.transfer_async(7, spec)
            assert result.success, result.error
            assert result.transfer_size == 6 * 2 * PAGE
            placed = {(6, 1): 0, (6, 2): 1, (4, 0): 2, (4, 1): 3, (1, 0): 8, (1, 1): 9}
            for t in range(2):
                for (cpu_block, sub), gpu_block in placed.items():
                    assert torch.equal(rig.cpu_page(t, cpu_block, sub), rig.gpu[t][gpu_block])
                untouched = [(6, 0), (4, 2), (1, 2)]
                for cpu_block, sub in untouched:
                    assert not rig.cpu_page(t, cpu_block, sub).any()
    finally:
        rig.close()


# ------------------------------------------------------------------ engine choice


def _plan(
    sizes: list[int], src: list[int] | None = None, dst: list[int] | None = None
) -> PointerPlan:
    n = len(sizes)
    src = src if src is not None else [i * 1_000_000 for i in range(n)]
    dst = dst if dst is not None else [i * 1_000_000 + 500_000 for i in range(n)]
    arr = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return PointerPlan(arr(src), arr(dst), arr(sizes), sum(sizes))


def test_engine_choice_follows_mean_page_size_and_mode() -> None:
    small, large = _plan([4096] * 8), _plan([65536] * 8)
    auto = {"mode": "auto", "kernel_below_bytes": 32768, "kernel_ready": True}
    assert choose_engine(small, **auto) == "kernel"  # type: ignore[arg-type]
    assert choose_engine(large, **auto) == "dma"  # type: ignore[arg-type]
    assert choose_engine(_plan([32768]), **auto) == "dma"  # type: ignore[arg-type]
    not_ready = {**auto, "kernel_ready": False}
    assert choose_engine(small, **not_ready) == "dma"  # type: ignore[arg-type]
    assert choose_engine(large, mode="kernel", kernel_below_bytes=0, kernel_ready=True) == "kernel"
    assert choose_engine(small, mode="dma", kernel_below_bytes=1 << 30, kernel_ready=True) == "dma"


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    # copies 0,1,2 are adjacent on both sides but listed out of order; 3 is not.
    plan = _plan([100, 100, 100, 50], src=[1200, 1000, 1100, 5000], dst=[7200, 7000, 7100, 9000])
    merged = coalesce(plan)
    assert merged.src_ptrs.tolist() == [1000, 5000]
    assert merged.dst_ptrs.tolist() == [7000, 9000]
    assert merged.sizes.tolist() == [300, 50]
    assert merged.total_bytes == plan.total_bytes
    # adjacent on the source only: left alone
    apart = _plan([100, 100], src=[0, 100], dst=[1000, 5000])
    assert len(coalesce(apart)) == 2


async def test_auto_engine_uses_kernel_for_small_pages(rig: Rig) -> None:
    async with rig.handler(True, kernel_below_bytes=PAGE + 1, coalesce_copies=False) as out:
        assert out.kernel_ready
        assert (await out.transfer_async(1, store([0], [0]))).success
        assert out.engine_counts == {"dma": 0, "kernel": 1}
    async with rig.handler(True, kernel_below_bytes=PAGE, coalesce_copies=False) as out:
        assert (await out.transfer_async(1, store([0], [0]))).success
        assert out.engine_counts == {"dma": 1, "kernel": 0}
    # one smoke-test launch per handler at setup, plus the one real kernel transfer
    assert rig.driver.calls["launch_kernel"] == 3
    assert rig.driver.calls["memcpy_batch_async"] == 1


async def test_kernel_compiled_once_per_driver_and_arch(rig: Rig) -> None:
    get_copy_kernel(rig.driver)
    async with rig.handler(True, engine="kernel"), rig.handler(False, engine="kernel"):
        pass
    assert rig.driver.kernels_compiled == {f"{COPY_KERNEL_NAME}@90": 1}
    assert f"void {COPY_KERNEL_NAME}(" in COPY_KERNEL_SOURCE


async def test_kernel_unavailable_falls_back_in_auto_and_raises_when_forced(
    fake: FakeDriver,
) -> None:
    gpu = [torch.zeros(4, PAGE, dtype=torch.int8)]
    cpu = [torch.zeros(4, PAGE, dtype=torch.int8)]  # not registered: not device-mapped
    refs = [[CanonicalKVCacheRef(0, PAGE)]]
    kv = canonical(gpu, refs)
    common = {"block_size_factor": 1, "gpu_to_cpu": False, "driver": fake}
    async with CudaOffloadingHandler(kv, cpu, **common) as handler:  # type: ignore[arg-type]
        assert not handler.kernel_ready
        assert handler.kernel_unavailable_reason is not None
        assert "cudaHostGetDevicePointer" in handler.kernel_unavailable_reason
        result = await handler.transfer_async(1, load([0], [1]))
        assert result.success and handler.engine_counts == {"dma": 1, "kernel": 0}
    with pytest.raises(CudaError, match="cudaErrorInvalidValue"):
        CudaOffloadingHandler(kv, cpu, **common, engine="kernel")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'magic'"):
        CudaOffloadingHandler(kv, cpu, **common, engine="magic")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- ordering


async def test_direction_is_fifo_even_across_pooled_streams(rig: Rig) -> None:
    async with rig.handler(False) as back:
        rig.cpu[0][0].fill_(1)
        rig.cpu[0][1].fill_(2)
        gate = rig.driver.gate_next_op()  # holds the first transfer's copy
        first = back.transfer_async(1, load([0], [4]))
        second = back.transfer_async(2, load([1], [4]))
        # The second write must land after the first, or block 4 ends up holding 1s.
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        gate.set()
        results = [await first, await second]
        assert [r.job_id for r in results] == [1, 2]
        assert all(r.success for r in results)
        assert torch.all(rig.gpu[0][4] == 2)
        assert rig.driver.calls["stream_wait_event"] >= 1


@pytest.mark.parametrize("how", ["current", "handle", "callable"])
async def test_store_waits_for_the_producer_stream(rig: Rig, how: str) -> None:
    producer = rig.driver.stream_create()
    options: dict[str, object] = {}
    if how == "current":
        rig.driver.set_current_stream(producer)
    elif how == "handle":
        options["producer_stream"] = producer
    else:
        options["producer_stream"] = lambda: producer
    async with rig.handler(True, **options) as out:
        gate = rig.driver.hold(producer)
        final = torch.full((PAGE,), 77, dtype=torch.int8)

        def finish_kv() -> None:  # the "model" writes block 2 late on its stream
            rig.gpu[0][2].copy_(final)

        rig.driver.enqueue_host(producer, finish_kv)
        task = out.transfer_async(1, store([2], [3]))
        gate.set()
        assert (await task).success
        assert torch.equal(rig.cpu[0][3], final)


@pytest.mark.parametrize("how", ["current", "handle", "callable"])
async def test_load_waits_for_the_producer_stream(rig: Rig, how: str) -> None:
    # vLLM zeroes freshly allocated blocks on its compute stream before the
    # forward, and submits the load after: the load must land after the zeroing.
    compute = rig.driver.stream_create()
    options: dict[str, object] = {}
    if how == "current":
        rig.driver.set_current_stream(compute)
    elif how == "handle":
        options["producer_stream"] = compute
    else:
        options["producer_stream"] = lambda: compute
    try:
        async with rig.handler(False, **options) as back:
            rig.cpu[0][3].fill_(55)
            gate = rig.driver.hold(compute)
            rig.driver.enqueue_host(compute, lambda: rig.gpu[0][2].zero_())
            task = back.transfer_async(1, load([3], [2]))
            gate.set()
            assert (await task).success
            assert torch.all(rig.gpu[0][2] == 55)
    finally:
        rig.driver.set_current_stream(None)


async def test_the_compute_stream_is_read_on_the_submitting_thread(rig: Rig) -> None:
    # torch's current stream is per thread: a transfer submitted on this thread
    # waits for this thread's stream, not for one another thread made current.
    mine, theirs = rig.driver.stream_create(), rig.driver.stream_create()
    rig.driver.set_current_stream(mine)
    other = threading.Thread(target=rig.driver.set_current_stream, args=(theirs,))
    other.start()
    other.join()
    try:
        async with rig.handler(False) as back:
            rig.cpu[0][1].fill_(9)
            mine_gate, theirs_gate = rig.driver.hold(mine), rig.driver.hold(theirs)
            rig.driver.enqueue_host(mine, lambda: rig.gpu[0][5].zero_())
            task = back.transfer_async(1, load([1], [5]))
            await asyncio.sleep(0.05)
            assert not task.done()  # waits for this thread's stream ...
            mine_gate.set()
            assert (await task).success  # ... and only for it
            assert torch.all(rig.gpu[0][5] == 9)
            theirs_gate.set()
    finally:
        rig.driver.set_current_stream(None)


async def test_transfer_time_comes_from_timing_events(rig: Rig) -> None:
    async with rig.handler(False) as timed, rig.handler(False, timing=False) as untimed:
        result = await timed.transfer_async(1, load([0], [0]))
        assert result.transfer_time is not None and result.transfer_time > 0
        assert rig.driver.calls["event_elapsed_ms"] == 1
        result = await untimed.transfer_async(2, load([0], [0]))
        assert result.success and rig.driver.calls["event_elapsed_ms"] == 1


# -------------------------------------------------------------------- error paths


async def handed_back(check: Callable[[], bool], what: str) -> None:
    """Wait for ``check()``. A transfer the loop saw finish while a waiter thread
    was still inside cudaEventSynchronize hands its stream and events back as that
    thread leaves the driver: on a loaded machine, after the result arrived."""
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"{what} never handed back"
        await asyncio.sleep(0.001)


def _pools_idle(handler: CudaOffloadingHandler) -> bool:
    pools = [handler._streams, handler._events]
    if handler._timing_events is not None:
        pools.append(handler._timing_events)
    return all(p.outstanding == 0 for p in pools)


@pytest.mark.parametrize(
    ("call", "engine"),
    [
        ("stream_create", "dma"),
        ("event_create", "dma"),
        ("event_record", "dma"),
        ("stream_wait_event", "dma"),
        ("memcpy_batch_async", "dma"),
        ("launch_kernel", "kernel"),
    ],
)
async def test_cuda_failure_at_submission_raises_and_leaks_nothing(
    rig: Rig, call: str, engine: str
) -> None:
    async with rig.handler(True, engine=engine) as out:
        rig.driver.fail_call(call)
        with pytest.raises(CudaError, match=call):
            out.transfer_async(1, store([0], [0]))
        assert out.in_flight == 0 and _pools_idle(out)
        assert out._in_flight == {}
        # The same job id works afterwards, and the direction still flows.
        result = await out.transfer_async(1, store([1], [1]))
        assert result.success, result.error
        assert torch.equal(rig.cpu[0][1], rig.gpu[0][1])
    await handed_back(lambda: rig.driver.live_events == 0, "the events")
    assert rig.driver.live_host_allocations == 0


@pytest.mark.parametrize("call", ["host_alloc", "compile_kernel", "launch_kernel"])
async def test_kernel_setup_failure_falls_back_or_raises_without_leaks(
    rig: Rig, call: str
) -> None:
    rig.driver.fail_call(call)
    async with rig.handler(True) as out:
        assert not out.kernel_ready
        assert out.kernel_unavailable_reason is not None
        assert call in out.kernel_unavailable_reason
        assert (await out.transfer_async(1, store([2], [2]))).success
    assert rig.driver.live_host_allocations == 0
    rig.driver.fail_call(call)
    with pytest.raises(CudaError, match=call):
        rig.handler(True, engine="kernel")
    assert rig.driver.live_host_allocations == 0


async def test_cuda_failure_at_completion_is_a_failed_result(rig: Rig) -> None:
    async with rig.handler(False) as back:
        rig.driver.fail_next_op()
        failed = await back.transfer_async(1, load([0], [0]))
        assert not failed.success
        assert isinstance(failed.error, CudaError)
        assert failed.error.name == "cudaErrorLaunchFailure"
        assert back.get_finished_nowait() == [failed]
        await handed_back(lambda: _pools_idle(back), "the failed transfer's handles")
        streams_after_failure = rig.driver.live_streams
        ok = await back.transfer_async(2, load([1], [1]))
        assert ok.success
        # the failed stream was destroyed, not pooled: the next one is new
        assert rig.driver.live_streams == streams_after_failure + 1


async def test_bad_input_raises_before_anything_is_enqueued(rig: Rig) -> None:
    async with rig.handler(True) as out:
        before = sum(rig.driver.calls.values())
        with pytest.raises(TransferSpecError, match="out of range"):
            out.transfer_async(1, store([GPU_BLOCKS], [0]))
        with pytest.raises(TransferSpecError, match="GPU -> CPU"):
            out.transfer_async(2, load([0], [0]))
        assert sum(rig.driver.calls.values()) == before


async def test_failure_creating_the_second_timing_event_leaks_nothing(rig: Rig) -> None:
    async with rig.handler(False) as back:
        original = rig.driver.event_create
        count = 0

        def flaky(*, timing: bool) -> int:
            nonlocal count
            count += 1
            if count == 3:  # end event, timing start, then the timing stop fails
                raise CudaError("cudaEventCreateWithFlags", "cudaErrorMemoryAllocation", 2)
            return original(timing=timing)

        rig.driver.event_create = flaky  # type: ignore[method-assign]
        with pytest.raises(CudaError, match="cudaErrorMemoryAllocation"):
            back.transfer_async(1, load([0], [0]))
        assert _pools_idle(back)
        assert back._timing_events is not None and back._timing_events.idle == 1
        assert (await back.transfer_async(1, load([0], [0]))).success


def test_gpu_tensors_need_matching_cpu_tensors(fake: FakeDriver) -> None:
    with pytest.raises(ConfigError, match="2 GPU tensors but 1 CPU"):
        CudaOffloadingHandler(
            canonical([torch.zeros(2, 4, dtype=torch.int8)] * 2, [[CanonicalKVCacheRef(0, 4)]]),
            [torch.zeros(2, 4, dtype=torch.int8)],
            block_size_factor=1,
            gpu_to_cpu=True,
            driver=fake,
        )


# --------------------------------------------------------------------- lifetimes


async def test_references_are_kept_until_the_end_event_fires(rig: Rig) -> None:
    async with rig.handler(True, engine="kernel") as out:
        gate = rig.driver.gate_next_op()
        task = out.transfer_async(1, store([0, 1], [2, 3]))
        (record_ref,) = out.in_flight_refs()
        record = record_ref()
        assert record is not None and record.plan is not None
        assert record.descriptors is not None
        descriptors = record.descriptors
        src_ptrs = weakref.ref(record.plan.src_ptrs)
        gc.collect()
        assert src_ptrs() is not None  # still referenced while the copy may run
        assert out._kernel is not None
        assert descriptors not in out._kernel._free.get(descriptors.capacity, [])
        assert record.stream is not None and out._streams.outstanding == 1
        gate.set()
        assert (await task).success
        await handed_back(lambda: _pools_idle(out), "the transfer's handles")
        gc.collect()
        assert src_ptrs() is None
        assert record.plan is None and record.descriptors is None and record.stream is None
        assert out.in_flight_refs() == [] and _pools_idle(out)
        # the descriptor table went back to the pool, not to the allocator
        assert out._kernel._free == {descriptors.capacity: [descriptors]}


async def test_aclose_drains_in_flight_transfers_then_destroys_everything(rig: Rig) -> None:
    out = rig.handler(True, engine="kernel")
    gate = rig.driver.gate_next_op()
    tasks = [out.transfer_async(i, store([i], [i])) for i in range(3)]
    closing = asyncio.ensure_future(out.aclose())
    await asyncio.sleep(0.02)
    assert not closing.done() and out.in_flight == 3
    gate.set()
    await closing
    results = [await t for t in tasks]
    assert all(r.success for r in results)
    assert [r.job_id for r in out.get_finished_nowait()] == [0, 1, 2]
    driver = rig.driver  # waiter threads still in the driver may finish after aclose
    await handed_back(lambda: not driver.live_events and driver.live_streams == 1, "handles")
    assert driver.live_events == 0
    assert driver.live_streams == 1  # only the fake's "current" producer stream
    assert driver.live_host_allocations == 0


async def test_no_event_is_destroyed_under_a_waiter_thread_still_in_the_driver(
    rig: Rig,
) -> None:
    # The loop's fallback poll can deliver a completion while the lane's waiter
    # thread is still inside cudaEventSynchronize on the same event; closing the
    # handler then destroyed that event under it (a segfault on an H200).
    out = rig.handler(True, engine="dma")
    driver = rig.driver
    before = driver.calls["event_synchronize"]
    copy_gate = driver.gate_next_op()
    sync_gate = driver.hold_next_synchronize()
    task = out.transfer_async(1, store([4], [2]))
    deadline = time.monotonic() + 30
    while driver.calls["event_synchronize"] == before:  # the waiter is in the driver
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    copy_gate.set()
    result = await task  # delivered by the loop: the waiter is held inside the call
    assert result.success, result.error
    # The waiter is inside the call; once it wakes it takes the hold (and stays).
    await handed_back(lambda: driver._sync_gate is None, "the hold")
    await out.aclose()
    assert driver.destroyed_while_waited == 0
    assert driver.live_events > 0  # the held event outlives the close ...
    sync_gate.set()
    while driver.live_events:  # ... until its waiter comes back out
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    assert driver.destroyed_while_waited == 0
    assert torch.equal(rig.cpu[0][2], rig.gpu[0][4])


async def test_cancelled_wait_does_not_cancel_the_copy(rig: Rig) -> None:
    async with rig.handler(True) as out:
        gate = rig.driver.gate_next_op()
        task = out.transfer_async(1, store([5], [6]))
        waiter = asyncio.ensure_future(task)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        waiter.cancel()
        gate.set()
        await out.wait([1])
        assert torch.equal(rig.cpu[0][6], rig.gpu[0][5])
        assert [r.job_id for r in out.get_finished_nowait()] == [1]


# ------------------------------------------------------------------ pinned memory


def test_host_registration_registers_in_chunks_and_unregisters(fake: FakeDriver) -> None:
    reg = HostRegistration(0x10000, 10_000, driver=fake, max_chunk=4096)
    assert reg.chunks == [(0x10000, 4096), (0x11000, 4096), (0x12000, 1808)]
    assert not reg.registered and fake.registered == {}
    with reg:
        assert fake.registered == {0x10000: 4096, 0x11000: 4096, 0x12000: 1808}
        reg.register()  # idempotent
        assert fake.calls["host_register"] == 3
        assert reg.device_pointer(0x11000 + 5) == 0x11000 + 5
    assert fake.registered == {} and not reg.registered


def test_host_registration_undoes_partial_work_on_failure(fake: FakeDriver) -> None:
    fake.host_register(0x12010, 16)  # someone else already pinned a page of chunk 3
    reg = HostRegistration(0x10000, 10_000, driver=fake, max_chunk=4096)
    with pytest.raises(CudaError, match="cudaErrorHostMemoryAlreadyRegistered"):
        reg.register()
    assert fake.registered == {0x12010: 16}
    assert not reg.registered


def test_host_registration_rejects_bad_arguments(fake: FakeDriver) -> None:
    with pytest.raises(ConfigError, match="-5"):
        HostRegistration(0x1000, -5, driver=fake)
    with pytest.raises(ConfigError, match="max_chunk"):
        HostRegistration(0x1000, 5, driver=fake, max_chunk=0)
    reg = HostRegistration(0x1000, 16, driver=fake)
    with pytest.raises(ConfigError, match="0x2000"):
        reg.device_pointer(0x2000)


def test_pinned_host_tensor_owns_its_registration(fake: FakeDriver) -> None:
    with PinnedHostTensor(4, 64, driver=fake) as pinned, PinnedHostTensor(3, 8, driver=fake):
        # small pools get pages of their own, so each can be registered
        assert pinned.tensor.shape == (4, 64) and pinned.tensor.dtype == torch.int8
        assert not pinned.tensor.any()
        assert pinned.tensor.data_ptr() % 4096 == 0
        assert fake.registered[pinned.tensor.data_ptr()] == 4096
        assert len(fake.registered) == 2
        assert not pinned.closed
    assert pinned.closed and fake.registered == {}


def test_fake_streams_run_in_order_and_events_see_them(fake: FakeDriver) -> None:
    stream = fake.stream_create()
    event = fake.event_create(timing=False)
    seen: list[int] = []
    gate = fake.hold(stream)
    fake.enqueue_host(stream, lambda: seen.append(1))
    fake.event_record(event, stream)
    assert fake.event_query(event) is False
    released = threading.Timer(0.01, gate.set)
    released.start()
    fake.event_synchronize(event)
    assert seen == [1] and fake.event_query(event) is True
    fake.event_destroy(event)
    fake.stream_destroy(stream)


def test_a_raising_stream_op_fails_later_events_and_the_stream_runs_on(fake: FakeDriver) -> None:
    stream = fake.stream_create()
    event = fake.event_create(timing=False)

    def broken() -> None:
        raise ValueError("host op bug")

    fake.enqueue_host(stream, broken)
    ran: list[int] = []
    fake.enqueue_host(stream, lambda: ran.append(1))
    fake.event_record(event, stream)
    with pytest.raises(CudaError, match=r"cudaErrorLaunchFailure.*host op bug"):
        fake.event_synchronize(event)  # fails, instead of waiting for a dead thread
    fake.stream_synchronize(stream)
    assert ran == [1]
    fake.event_destroy(event)
    fake.stream_destroy(stream)


# ------------------------------------------------------------- pair and region


async def test_make_cuda_handlers_pins_the_pool_and_unpins_it_on_close(fake: FakeDriver) -> None:
    kv = [torch.randn(6, 4, 32).to(torch.bfloat16) for _ in range(3)]  # 256-byte pages
    caches = CanonicalKVCaches.from_block_tensors([kv[:2], kv[2:]])
    handlers = make_cuda_handlers(caches, block_size_factor=2, num_cpu_blocks=4, driver=fake)
    assert isinstance(handlers, CpuGpuHandlers)
    assert [tuple(t.shape) for t in handlers.cpu_tensors] == [(4, 512)] * 3
    assert len(fake.registered) == 3
    async with handlers:
        spec = GPULoadStoreSpec([1, 2, 5], [2, 1], [0, 0]), CPULoadStoreSpec([3, 0])
        assert (await handlers.gpu_to_cpu.transfer_async(1, spec)).success
        raw = [t.view(torch.int8).reshape(6, -1) for t in kv]
        assert torch.equal(handlers.cpu_tensors[0][3], torch.cat([raw[0][1], raw[0][2]]))
        assert torch.equal(handlers.cpu_tensors[2][0, :256], raw[2][5])
        saved = raw[0][[1, 2]].clone()
        raw[0][[1, 2]] = 0
        back = CPULoadStoreSpec([3]), GPULoadStoreSpec([1, 2], [2, 0], [0, 0])
        assert (await handlers.cpu_to_gpu.transfer_async(2, back)).success
        assert torch.equal(raw[0][[1, 2]], saved)
    assert fake.registered == {}
    await handed_back(lambda: fake.live_events == 0, "the events")


def test_make_cuda_handlers_rejects_bad_sizes(fake: FakeDriver) -> None:
    caches = CanonicalKVCaches.from_block_tensors([[torch.zeros(2, 8, dtype=torch.int8)]])
    with pytest.raises(ConfigError, match="-1"):
        make_cuda_handlers(caches, block_size_factor=1, num_cpu_blocks=-1, driver=fake)
    assert fake.registered == {}


def test_shared_region_pins_through_host_registration(fake: FakeDriver, tmp_path: Path) -> None:
    region = SharedOffloadRegion(
        f"cudafake{os.getpid()}",
        num_blocks=4,
        num_workers=2,
        page_bytes_per_rank=4096,
        rank=0,
        directory=tmp_path,
    )
    try:
        region.pin(driver=fake)
        region.pin(driver=fake)  # idempotent
        assert region.is_pinned
        ((base, size),) = fake.registered.items()
        assert size >= 4 * 2 * 4096
        view = region.create_next_view(4096)
        assert base <= view.data_ptr() < base + size
        del view
    finally:
        region.close()
    assert fake.registered == {}


def test_bench_cuda_runs_end_to_end_on_the_fake_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_cuda.py"
    spec = importlib.util.spec_from_file_location("bench_cuda", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cuda", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    args = ["--fake", "--out", str(tmp_path), "--iters", "1", "--total-mib", "1",
            "--llama-pool-blocks", "64", "--latency-trials", "1"]
    assert bench.main(args) == 0
    report = json.loads((tmp_path / "bench_cuda.json").read_text())
    assert report["meta"]["fake"] is True
    methods = {(r["case"], r["direction"], r["method"]) for r in report["rows"]}
    for case in ("sweep", "llama3-8b"):
        for direction in ("GPU->CPU", "CPU->GPU"):
            for method in ("ceiling", "dma", "kernel", "torch copy_ loop"):
                assert (case, direction, method) in methods
    assert "FAKE" in (tmp_path / "bench_cuda.md").read_text()
