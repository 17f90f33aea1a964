"""Both host directions over one CPU pool, as ``make_cpu_gpu_handlers`` wants them."""

from __future__ import annotations

from typing import Any

import torch

from aiokvo._util import check_int
from aiokvo.handlers.base import CpuGpuHandlers
from aiokvo.handlers.host.handler import HostOffloadingHandler
from aiokvo.layout import CanonicalKVCaches

__all__ = ["allocate_cpu_pool", "make_host_handlers"]


def allocate_cpu_pool(
    kv_caches: CanonicalKVCaches, *, block_size_factor: int, num_cpu_blocks: int
) -> tuple[torch.Tensor, ...]:
    """One zeroed ``(num_cpu_blocks, page_size_bytes * block_size_factor)`` int8
    tensor per canonical KV tensor."""
    block_size_factor = check_int("block_size_factor", block_size_factor, minimum=1)
    num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
    return tuple(
        torch.zeros((num_cpu_blocks, t.page_size_bytes * block_size_factor), dtype=torch.int8)
        for t in kv_caches.tensors
    )


def make_host_handlers(
    kv_caches: CanonicalKVCaches,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
    **options: Any,
) -> CpuGpuHandlers:
    """A store and a load :class:`HostOffloadingHandler` over a fresh CPU pool.

    ``options`` go to both handlers (``poller_mode``, ``max_buffered``,
    ``copy_threads``, ``copy_fn``, ``inline_after``, ``split_min_bytes``).
    """
    cpu_tensors = allocate_cpu_pool(
        kv_caches, block_size_factor=block_size_factor, num_cpu_blocks=num_cpu_blocks
    )
    store = HostOffloadingHandler(
        kv_caches, cpu_tensors, block_size_factor=block_size_factor, gpu_to_cpu=True, **options
    )
    load = HostOffloadingHandler(
        kv_caches, cpu_tensors, block_size_factor=block_size_factor, gpu_to_cpu=False, **options
    )
    return CpuGpuHandlers(gpu_to_cpu=store, cpu_to_gpu=load, cpu_tensors=cpu_tensors)
