"""Both directions between the KV caches and a CPU block pool, for whichever device holds them.

:func:`make_cpu_gpu_handlers` is the one call the wiring layer makes:
CPU-resident KV caches get the host backend, CUDA-resident ones the CUDA
backend (imported lazily, so this module works on machines without CUDA).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, TypeAlias

from aiokvo.errors import CudaUnavailableError
from aiokvo.handlers.base import CpuGpuHandlers, OffloadingHandler
from aiokvo.handlers.host.pair import make_host_handlers
from aiokvo.layout import CanonicalKVCaches
from aiokvo.specs import LoadStoreSpec

if TYPE_CHECKING:
    from aiokvo.memory.shared_region import SharedOffloadRegion

__all__ = ["HandlerRoute", "make_cpu_gpu_handlers"]

HandlerRoute: TypeAlias = "tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]"
"""``(src_spec_type, dst_spec_type, handler)``, ready for ``register_handler``."""


def make_cpu_gpu_handlers(
    kv_caches: CanonicalKVCaches,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
    region: SharedOffloadRegion | None = None,
    **options: Any,
) -> CpuGpuHandlers:
    """Build both directions for ``kv_caches`` over one CPU pool.

    The pool is private to the pair, or, with ``region``, one
    :meth:`~aiokvo.memory.shared_region.SharedOffloadRegion.create_next_view`
    slice per KV tensor of a region every rank of the engine maps (the pair
    borrows it: close the pair, then the region). ``options`` go to each
    handler's constructor (see ``make_host_handlers`` and
    ``aiokvo.handlers.cuda.make_cuda_handlers``). Raises
    :class:`~aiokvo.errors.CudaUnavailableError` for CUDA caches when the
    CUDA backend cannot load, and :class:`~aiokvo.errors.LayoutError` for
    caches on any device but ``cpu`` and ``cuda``.
    """
    common: dict[str, Any] = {
        "block_size_factor": block_size_factor,
        "num_cpu_blocks": num_cpu_blocks,
        "region": region,
        **options,
    }
    if not kv_caches.is_cuda:
        return make_host_handlers(kv_caches, **common)
    try:
        # Imported by name so this module never needs CUDA to import.
        make_cuda_handlers = importlib.import_module("aiokvo.handlers.cuda.pair").make_cuda_handlers
    except (ImportError, AttributeError) as exc:
        raise CudaUnavailableError(
            f"CUDA backend not available for KV caches on {kv_caches.device}: {exc}"
        ) from exc
    handlers = make_cuda_handlers(kv_caches, **common)
    if not isinstance(handlers, CpuGpuHandlers):
        raise TypeError(f"make_cuda_handlers returned {handlers!r}, not CpuGpuHandlers")
    return handlers
