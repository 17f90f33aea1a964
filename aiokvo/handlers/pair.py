"""Both directions between the KV caches and a CPU block pool, built together.

:func:`make_cpu_gpu_handlers` allocates the CPU pool (one tensor per
canonical KV tensor, each row one offloaded block) and returns a store
handler and a load handler over it. CPU-resident KV caches get the host
backend; CUDA-resident ones are handed to the CUDA backend, imported lazily
so that this module works on machines without CUDA.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from aiokvo._util import AsyncResource
from aiokvo.errors import ConfigError, CudaUnavailableError
from aiokvo.handlers.base import OffloadingHandler
from aiokvo.handlers.host import HostOffloadingHandler
from aiokvo.layout import CanonicalKVCaches

__all__ = ["CpuGpuHandlers", "allocate_cpu_pool", "make_cpu_gpu_handlers"]


@dataclass(slots=True)
class CpuGpuHandlers(AsyncResource):
    """A store (``gpu_to_cpu``) and a load (``cpu_to_gpu``) handler sharing one CPU pool.

    ``cpu_tensors[i]`` holds the offloaded blocks of canonical tensor ``i``.
    Closing closes both handlers; use it as an async context manager.
    """

    gpu_to_cpu: OffloadingHandler
    cpu_to_gpu: OffloadingHandler
    cpu_tensors: tuple[torch.Tensor, ...]

    async def aclose(self) -> None:
        """Close both directions (each waits for its copies in flight)."""
        try:
            await self.gpu_to_cpu.aclose()
        finally:
            await self.cpu_to_gpu.aclose()


def allocate_cpu_pool(
    kv_caches: CanonicalKVCaches, *, block_size_factor: int, num_cpu_blocks: int
) -> tuple[torch.Tensor, ...]:
    """One zeroed ``(num_cpu_blocks, page_size_bytes * block_size_factor)`` int8
    tensor per canonical KV tensor."""
    _check_positive("block_size_factor", block_size_factor, minimum=1)
    _check_positive("num_cpu_blocks", num_cpu_blocks, minimum=0)
    return tuple(
        torch.zeros((num_cpu_blocks, t.page_size_bytes * block_size_factor), dtype=torch.int8)
        for t in kv_caches.tensors
    )


def make_cpu_gpu_handlers(
    kv_caches: CanonicalKVCaches,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
    **options: Any,
) -> CpuGpuHandlers:
    """Build both directions for ``kv_caches`` over a fresh CPU pool.

    ``options`` go to each handler's constructor (for the host backend:
    ``poller_mode``, ``max_buffered``, ``copy_threads``, ``copy_fn``,
    ``inline_after``). When the KV caches live
    on a CUDA device, the call is delegated to
    ``aiokvo.handlers.cuda.pair.make_cuda_handlers`` with the same arguments;
    :class:`~aiokvo.errors.CudaUnavailableError` if that backend cannot load.
    """
    if kv_caches.is_cuda:
        try:
            # Imported by name so this module never needs CUDA to import.
            module = importlib.import_module("aiokvo.handlers.cuda.pair")
            make_cuda_handlers = module.make_cuda_handlers
        except (ImportError, AttributeError) as exc:
            raise CudaUnavailableError(
                f"CUDA backend not available for KV caches on {kv_caches.device}: {exc}"
            ) from exc
        handlers = make_cuda_handlers(
            kv_caches,
            block_size_factor=block_size_factor,
            num_cpu_blocks=num_cpu_blocks,
            **options,
        )
        if not isinstance(handlers, CpuGpuHandlers):
            raise TypeError(f"make_cuda_handlers returned {handlers!r}, not CpuGpuHandlers")
        return handlers
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


def _check_positive(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
