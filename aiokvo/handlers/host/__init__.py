"""The host backend: copies between CPU tensors, on a dispatch thread.

:mod:`.copies` moves pages with a few numpy calls, :mod:`.dispatch` runs jobs
in order on one thread (the loop steps in when that thread is starved of the
GIL), :mod:`.handler` is the handler, and :mod:`.pair` builds both
directions over one pool.
"""

from aiokvo.handlers.host.copies import CopyFn, HostCopy, apply_host_copies, host_copy_steps
from aiokvo.handlers.host.dispatch import DispatchEvent, DispatchThread
from aiokvo.handlers.host.handler import (
    DEFAULT_COPY_THREADS,
    INLINE_AFTER,
    SPLIT_MIN_BYTES,
    HostOffloadingHandler,
)
from aiokvo.handlers.host.pair import allocate_cpu_pool, make_host_handlers

__all__ = [
    "DEFAULT_COPY_THREADS",
    "INLINE_AFTER",
    "SPLIT_MIN_BYTES",
    "CopyFn",
    "DispatchEvent",
    "DispatchThread",
    "HostCopy",
    "HostOffloadingHandler",
    "allocate_cpu_pool",
    "apply_host_copies",
    "host_copy_steps",
    "make_host_handlers",
]
