"""Copy engines: how one transfer's page copies are enqueued on a stream.

* :class:`DmaEngine` hands the pages to the copy engines, as one
  ``cudaMemcpyBatchAsync`` where the driver has it (CUDA >= 12.8) or a loop
  of ``cudaMemcpyAsync`` otherwise. Best for large pages.
* :class:`KernelEngine` launches :mod:`~aiokvo.handlers.cuda.kernel`'s copy
  kernel over a descriptor table. Best for small pages, where DMA pays a
  fixed cost per copy.

:func:`choose_engine` picks one per transfer from its mean page size and
``kernel_below_bytes``. Adjacent pages that are contiguous on both sides
are merged first (:func:`coalesce`), which helps both engines.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np

from aiokvo._util import check_choice
from aiokvo.device.driver import CudaDriver
from aiokvo.errors import CudaError
from aiokvo.handlers.cuda.kernel import DESCRIPTOR_WORDS, get_copy_kernel
from aiokvo.plan import Int64Array, PointerPlan

__all__ = [
    "DEFAULT_KERNEL_BELOW_BYTES",
    "DescriptorBuffer",
    "DmaBatch",
    "DmaEngine",
    "EngineMode",
    "EngineName",
    "KernelEngine",
    "choose_engine",
    "coalesce",
]

EngineName: TypeAlias = Literal["dma", "kernel"]
EngineMode: TypeAlias = Literal["auto", "dma", "kernel"]

DEFAULT_KERNEL_BELOW_BYTES = 2 * 1024 * 1024
"""Pages smaller than this (on average) go to the kernel in ``"auto"`` mode.

Measured on an H200 (``benchmarks/bench_cuda.py``, 2026-12-04, RESULTS.md):
the kernel holds 90-94% of the contiguous-copy ceiling from 4 KiB to 256 KiB
pages in both directions, where DMA gets 3-80%; at 2 MiB DMA wins both ways
(95-98% against 82-92%). Sizes between 256 KiB and 2 MiB go to the kernel.
"""

_ENGINE_MODES: tuple[EngineMode, ...] = ("auto", "dma", "kernel")


def check_engine_mode(mode: str) -> EngineMode:
    """Validate a user-supplied engine mode."""
    return check_choice("engine", mode, _ENGINE_MODES)


def choose_engine(
    plan: PointerPlan, *, mode: EngineMode, kernel_below_bytes: int, kernel_ready: bool
) -> EngineName:
    """The engine for one transfer: forced by ``mode``, else by mean page size."""
    if mode != "auto":
        return mode
    if not kernel_ready or len(plan) == 0:
        return "dma"
    mean_page = plan.total_bytes / len(plan)
    return "kernel" if mean_page < kernel_below_bytes else "dma"


def coalesce(plan: PointerPlan) -> PointerPlan:
    """Merge runs of copies that are contiguous on both sides into single copies.

    Copies are first ordered by source address, so a batch of consecutive
    blocks becomes one large copy whatever order the caller listed them in.
    """
    n = len(plan)
    if n < 2:
        return plan
    order = np.argsort(plan.src_ptrs, kind="stable")
    src, dst, size = plan.src_ptrs[order], plan.dst_ptrs[order], plan.sizes[order]
    joins = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
    if not joins.any():
        return plan
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    sizes = np.add.reduceat(size, starts).astype(np.int64, copy=False)
    return PointerPlan(src[starts], dst[starts], sizes, plan.total_bytes)


class DmaEngine:
    """Enqueue page copies on the DMA engines."""

    name: EngineName = "dma"

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver

    @staticmethod
    def prepare(plan: PointerPlan) -> DmaBatch:
        """Host-side work, done before the transfer's timing start event."""
        return DmaBatch(plan.dst_ptrs.tolist(), plan.src_ptrs.tolist(), plan.sizes.tolist())

    def enqueue(self, stream: int, batch: DmaBatch, *, gpu_to_cpu: bool) -> None:
        # GPU->CPU reads device memory written by earlier kernels on other
        # streams, so the source must be read in stream order; CPU->GPU
        # sources are pinned pages nobody writes meanwhile, so ANY is safe.
        if not batch.sizes:
            return
        self._driver.memcpy_batch_async(
            batch.dsts, batch.srcs, batch.sizes, stream, src_in_stream_order=gpu_to_cpu
        )


@dataclass(slots=True, frozen=True)
class DmaBatch:
    """A plan as the Python int lists the driver call takes."""

    dsts: list[int]
    srcs: list[int]
    sizes: list[int]


@dataclass(slots=True, eq=False)
class DescriptorBuffer:
    """Mapped pinned host memory holding a descriptor table; pooled by capacity."""

    host_ptr: int
    device_ptr: int
    capacity: int  # descriptors
    count: int = 0  # descriptors filled by the last prepare()

    def view(self, count: int) -> Int64Array:
        """The first ``count`` descriptors as a writable ``(count, 3)`` int64 array."""
        words = (ctypes.c_int64 * (self.capacity * DESCRIPTOR_WORDS)).from_address(self.host_ptr)
        table: Int64Array = np.ctypeslib.as_array(words)
        return table[: count * DESCRIPTOR_WORDS].reshape(count, DESCRIPTOR_WORDS)


class KernelEngine:
    """Enqueue page copies as one launch of the SM copy kernel.

    ``pointer_offset`` is added to host-side addresses to get the
    addresses the device sees (0 under UVA); it applies to the CPU side of
    the plan only. Descriptor tables come from a per-engine pool and must
    be handed back with :meth:`release` once the launch has completed.
    """

    name: EngineName = "kernel"

    def __init__(
        self, driver: CudaDriver, *, block: int = 256, blocks_per_sm: int = 8
    ) -> None:
        self._driver = driver
        self._kernel = get_copy_kernel(driver)
        self._block = block
        self._max_grid = max(1, driver.sm_count() * blocks_per_sm)
        self._free: dict[int, list[DescriptorBuffer]] = {}
        self._out: set[int] = set()
        self._all: list[DescriptorBuffer] = []
        self._closed = False
        self._lock = threading.Lock()

    def _acquire(self, count: int) -> DescriptorBuffer:
        capacity = 1 << max(6, (count - 1).bit_length())
        with self._lock:
            if self._closed:
                raise RuntimeError("the kernel engine is closed")
            free = self._free.get(capacity)
            buffer = free.pop() if free else None
        if buffer is None:
            host = self._driver.host_alloc(capacity * DESCRIPTOR_WORDS * 8)
            try:
                device = self._driver.host_device_pointer(host)
            except CudaError:
                self._driver.host_free(host)
                raise
            buffer = DescriptorBuffer(host, device, capacity)
            with self._lock:
                self._all.append(buffer)
        with self._lock:
            self._out.add(id(buffer))
        return buffer

    def release(self, buffer: DescriptorBuffer) -> None:
        """Return a descriptor table after the launch that read it completed."""
        with self._lock:
            self._out.discard(id(buffer))
            if not self._closed:
                self._free.setdefault(buffer.capacity, []).append(buffer)
                return
            self._all.remove(buffer)
        self._driver.host_free(buffer.host_ptr)

    def prepare(
        self, plan: PointerPlan, *, gpu_to_cpu: bool, pointer_offset: int = 0
    ) -> DescriptorBuffer | None:
        """Fill a pooled descriptor table (host work, before the timing start event).

        The caller owns the table from here on and must :meth:`release` it
        (after the launch that reads it has completed, if there was one).
        """
        count = len(plan)
        if count == 0:
            return None
        buffer = self._acquire(count)
        table = buffer.view(count)
        src, dst = plan.src_ptrs, plan.dst_ptrs
        if pointer_offset:
            if gpu_to_cpu:
                dst = dst + pointer_offset
            else:
                src = src + pointer_offset
        table[:, 0] = src
        table[:, 1] = dst
        table[:, 2] = plan.sizes
        buffer.count = count
        return buffer

    def enqueue(self, stream: int, buffer: DescriptorBuffer | None) -> None:
        """Launch the kernel over a prepared table on ``stream``."""
        if buffer is None or buffer.count == 0:
            return
        grid = min(buffer.count, self._max_grid)
        self._driver.launch_kernel(
            self._kernel, stream, grid, self._block, (buffer.device_ptr, buffer.count)
        )

    def smoke_test(self, stream: int) -> None:
        """Launch over zero descriptors and wait: proves the kernel loads and runs here.

        Module loading can be lazy, so without this a driver that cannot load
        the cubin would fail every kernel transfer instead of the setup.
        """
        buffer = self._acquire(1)
        try:
            self._driver.launch_kernel(self._kernel, stream, 1, self._block, (buffer.device_ptr, 0))
            self._driver.stream_synchronize(stream)
        finally:
            self.release(buffer)

    def close(self) -> None:
        """Free idle tables now; outstanding ones are freed on release."""
        with self._lock:
            self._closed = True
            idle = [b for b in self._all if id(b) not in self._out]
            for buffer in idle:
                self._all.remove(buffer)
            self._free.clear()
        first: CudaError | None = None
        for buffer in idle:
            try:
                self._driver.host_free(buffer.host_ptr)
            except CudaError as exc:
                first = first or exc
        if first is not None:
            raise first
