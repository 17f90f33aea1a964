"""Both directions between the KV caches and a CPU block pool, for whichever device holds them.

:func:`make_cpu_gpu_handlers` is the one call the wiring layer makes:
CPU-resident KV caches get the host backend, CUDA-resident ones the CUDA
backend (imported lazily, so this module works on machines without CUDA).
"""

from __future__ import annotations

import importlib
from typing import Any, TypeAlias

from aiokvo.errors import CudaUnavailableError
from aiokvo.handlers.base import CpuGpuHandlers, OffloadingHandler
from aiokvo.handlers.host.pair import make_host_handlers
from aiokvo.layout import CanonicalKVCaches
from aiokvo.specs import LoadStoreSpec

__all__ = ["HandlerRoute", "make_cpu_gpu_handlers"]

HandlerRoute: TypeAlias = "tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]"
"""``(src_spec_type, dst_spec_type, handler)``, ready for ``register_handler``."""


def make_cpu_gpu_handlers(
    kv_caches: CanonicalKVCaches,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
    **options: Any,
) -> CpuGpuHandlers:
    """Build both directions for ``kv_caches`` over a fresh CPU pool.

    ``options`` go to each handler's constructor (see ``make_host_handlers``
    and ``aiokvo.handlers.cuda.make_cuda_handlers``). Raises
    :class:`~aiokvo.errors.CudaUnavailableError` for CUDA caches when the
    CUDA backend cannot load.
    """
    if not kv_caches.is_cuda:
        return make_host_handlers(
            kv_caches, block_size_factor=block_size_factor, num_cpu_blocks=num_cpu_blocks, **options
        )
    try:
        # Imported by name so this module never needs CUDA to import.
        make_cuda_handlers = importlib.import_module("aiokvo.handlers.cuda.pair").make_cuda_handlers
    except (ImportError, AttributeError) as exc:
        raise CudaUnavailableError(
            f"CUDA backend not available for KV caches on {kv_caches.device}: {exc}"
        ) from exc
    handlers = make_cuda_handlers(
        kv_caches, block_size_factor=block_size_factor, num_cpu_blocks=num_cpu_blocks, **options
    )
    if not isinstance(handlers, CpuGpuHandlers):
        raise TypeError(f"make_cuda_handlers returned {handlers!r}, not CpuGpuHandlers")
    return handlers

