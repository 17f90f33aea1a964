"""Both CUDA directions over one pinned CPU pool (private, or a shared region's views),
as ``make_cpu_gpu_handlers`` wants them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aiokvo._util import check_int
from aiokvo.device.driver import CudaDriver, load_driver
from aiokvo.handlers.base import CpuGpuHandlers
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler
from aiokvo.handlers.pool import padded_row_stride, region_pool
from aiokvo.layout import CanonicalKVCaches
from aiokvo.memory.pinned import DEFAULT_MAX_CHUNK, PinnedHostTensor

if TYPE_CHECKING:
    from aiokvo.memory.shared_region import SharedOffloadRegion

__all__ = ["CudaCpuGpuHandlers", "make_cuda_handlers"]


@dataclass(slots=True)
class CudaCpuGpuHandlers(CpuGpuHandlers):
    """:class:`CpuGpuHandlers` that also owns the pinned pool: closing unpins it last."""

    pinned: tuple[PinnedHostTensor, ...] = field(default=())

    async def aclose(self) -> None:
        try:
            await CpuGpuHandlers.aclose(self)
        finally:
            pinned, self.pinned = self.pinned, ()
            for pool in pinned:
                pool.close()


def make_cuda_handlers(
    kv_caches: CanonicalKVCaches,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
    region: SharedOffloadRegion | None = None,
    driver: CudaDriver | None = None,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    row_tail_bytes: int = 0,
    **options: Any,
) -> CudaCpuGpuHandlers:
    """A store and a load :class:`CudaOffloadingHandler` over one pinned CPU pool.

    Without ``region`` the pool has one ``(num_cpu_blocks, page_size_bytes *
    block_size_factor)`` int8 tensor per canonical KV tensor, registered with
    ``cudaHostRegister`` (portable, mapped) in chunks of ``max_chunk`` and
    unpinned when the pair closes, each row followed by ``row_tail_bytes`` of
    pinned room outside the view (:func:`~aiokvo.handlers.pool.padded_row_stride`).
    With ``region`` the pool is one view of the shared region per KV tensor
    (:func:`~aiokvo.handlers.pool.region_pool`, no tail room),
    and the whole region is pinned (:meth:`SharedOffloadRegion.pin`, a no-op
    if it already is) until the region closes; the pair borrows the region.
    ``options`` go to both handlers (``engine``, ``kernel_below_bytes``,
    ``timing``, ``producer_stream``, ``poller_mode``, ...). Raises
    :class:`~aiokvo.errors.CudaUnavailableError` without a GPU unless a
    ``driver`` (e.g. the fake) is given.
    """
    block_size_factor = check_int("block_size_factor", block_size_factor, minimum=1)
    num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
    row_tail_bytes = 0 if region is not None else row_tail_bytes
    row_tail_bytes = check_int("row_tail_bytes", row_tail_bytes, minimum=0)
    if driver is None:
        device = kv_caches.device
        driver = load_driver(device.index if device.type == "cuda" and device.index else 0)
    pinned: list[PinnedHostTensor] = []
    cpu_tensors: list[torch.Tensor] = []
    try:
        if region is not None:
            cpu_tensors.extend(
                region_pool(
                    kv_caches,
                    region,
                    block_size_factor=block_size_factor,
                    num_cpu_blocks=num_cpu_blocks,
                )
            )
            region.pin(driver=driver)
        for tensor in kv_caches.tensors if region is None else ():
            row_bytes = tensor.page_size_bytes * block_size_factor
            if num_cpu_blocks == 0:
                cpu_tensors.append(torch.empty((0, row_bytes), dtype=torch.int8))
                continue
            stride = padded_row_stride(row_bytes, row_tail_bytes)
            pool = PinnedHostTensor(num_cpu_blocks, stride, driver=driver, max_chunk=max_chunk)
            pinned.append(pool)
            cpu_tensors.append(pool.tensor[:, :row_bytes])
        common: dict[str, Any] = {
            "block_size_factor": block_size_factor,
            "driver": driver,
            **options,
        }
        store = CudaOffloadingHandler(kv_caches, cpu_tensors, gpu_to_cpu=True, **common)
        load = CudaOffloadingHandler(kv_caches, cpu_tensors, gpu_to_cpu=False, **common)
    except BaseException:
        for pool in pinned:
            pool.close()
        raise
    return CudaCpuGpuHandlers(
        gpu_to_cpu=store,
        cpu_to_gpu=load,
        cpu_tensors=tuple(cpu_tensors),
        region=region,
        row_tail_bytes=row_tail_bytes,
        pinned=tuple(pinned),
    )
