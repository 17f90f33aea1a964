"""Both host directions over one CPU pool (private, or a shared region's views),
as ``make_cpu_gpu_handlers`` wants them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from aiokvo._util import check_int
from aiokvo.handlers.base import CpuGpuHandlers
from aiokvo.handlers.host.handler import HostOffloadingHandler, check_host_caches
from aiokvo.handlers.pool import padded_row_stride, region_pool
from aiokvo.layout import CanonicalKVCaches

if TYPE_CHECKING:
    from aiokvo.memory.shared_region import SharedOffloadRegion

__all__ = ["allocate_cpu_pool", "make_host_handlers"]


def allocate_cpu_pool(
    kv_caches: CanonicalKVCaches,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
    row_tail_bytes: int = 0,
) -> tuple[torch.Tensor, ...]:
    """One zeroed ``(num_cpu_blocks, page_size_bytes * block_size_factor)`` int8
    tensor per canonical KV tensor, starting on a page boundary (so that a disk
    tier can read and write its rows with O_DIRECT when they are whole pages).

    With ``row_tail_bytes`` every row is followed by at least that much zeroed
    room outside the view (the stride is
    :func:`~aiokvo.handlers.pool.padded_row_stride`)."""
    block_size_factor = check_int("block_size_factor", block_size_factor, minimum=1)
    num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
    row_tail_bytes = check_int("row_tail_bytes", row_tail_bytes, minimum=0)
    widths = [t.page_size_bytes * block_size_factor for t in kv_caches.tensors]
    return tuple(
        _page_aligned_zeros(num_cpu_blocks, width, padded_row_stride(width, row_tail_bytes))
        for width in widths
    )


_PAGE = 4096


def _page_aligned_zeros(rows: int, width: int, stride: int) -> torch.Tensor:
    flat = torch.zeros(rows * stride + _PAGE, dtype=torch.int8)
    skip = -flat.data_ptr() % _PAGE
    return flat[skip : skip + rows * stride].view(rows, stride)[:, :width]


def make_host_handlers(
    kv_caches: CanonicalKVCaches,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
    region: SharedOffloadRegion | None = None,
    row_tail_bytes: int = 0,
    **options: Any,
) -> CpuGpuHandlers:
    """A store and a load :class:`HostOffloadingHandler` over one CPU pool.

    The pool is fresh zeroed tensors (with ``row_tail_bytes`` of room after
    every row: see :func:`allocate_cpu_pool`), or with ``region`` one view of
    the shared region per KV tensor (see
    :func:`~aiokvo.handlers.pool.region_pool`; the pair borrows the region;
    no tail room). ``options`` go to both handlers
    (``poller_mode``, ``max_buffered``, ``copy_threads``, ``copy_fn``,
    ``inline_after``, ``inline_below_bytes``, ``split_min_bytes``).
    """
    check_host_caches(kv_caches)
    if region is None:
        cpu_tensors = allocate_cpu_pool(
            kv_caches,
            block_size_factor=block_size_factor,
            num_cpu_blocks=num_cpu_blocks,
            row_tail_bytes=row_tail_bytes,
        )
    else:
        row_tail_bytes = 0
        cpu_tensors = region_pool(
            kv_caches, region, block_size_factor=block_size_factor, num_cpu_blocks=num_cpu_blocks
        )
    store = HostOffloadingHandler(
        kv_caches, cpu_tensors, block_size_factor=block_size_factor, gpu_to_cpu=True, **options
    )
    load = HostOffloadingHandler(
        kv_caches, cpu_tensors, block_size_factor=block_size_factor, gpu_to_cpu=False, **options
    )
    return CpuGpuHandlers(
        gpu_to_cpu=store,
        cpu_to_gpu=load,
        cpu_tensors=cpu_tensors,
        region=region,
        row_tail_bytes=row_tail_bytes,
    )
