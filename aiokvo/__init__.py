"""aiokvo: asyncio-first offloading of LLM KV-cache blocks between GPU and CPU memory.

Every public name is importable from here. Names are resolved lazily
(PEP 562) so that ``import aiokvo.manager`` — the pure, synchronous core —
pulls in neither asyncio, torch nor CUDA; only the names you touch load
their layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # keys and specs
    "OffloadKey": "aiokvo.keys",
    "make_offload_key": "aiokvo.keys",
    "get_offload_block_hash": "aiokvo.keys",
    "get_offload_group_idx": "aiokvo.keys",
    "ReqContext": "aiokvo.specs",
    "LoadStoreSpec": "aiokvo.specs",
    "BlockIDsLoadStoreSpec": "aiokvo.specs",
    "GPULoadStoreSpec": "aiokvo.specs",
    "CPULoadStoreSpec": "aiokvo.specs",
    "PrepareStoreOutput": "aiokvo.specs",
    "OffloadingEvent": "aiokvo.specs",
    "TransferSpec": "aiokvo.specs",
    "TransferType": "aiokvo.specs",
    "TransferResult": "aiokvo.specs",
    # managers and policies
    "OffloadingManager": "aiokvo.manager.base",
    "CPUOffloadingManager": "aiokvo.manager.cpu",
    "FilterReusedOffloadingManager": "aiokvo.manager.reuse",
    "CachePolicy": "aiokvo.manager.policies",
    "LRUCachePolicy": "aiokvo.manager.policies",
    "ARCCachePolicy": "aiokvo.manager.policies",
    "BlockStatus": "aiokvo.manager.policies",
    # events
    "EventSubscription": "aiokvo.events",
    "Lagged": "aiokvo.events",
    # runtime
    "run": "aiokvo.runtime.run",
    "EventPoller": "aiokvo.runtime.poller",
    "PollerMode": "aiokvo.runtime.poller",
    "CompletionSource": "aiokvo.runtime.sources",
    "HostEvent": "aiokvo.runtime.sources",
    # handlers
    "OffloadingHandler": "aiokvo.handlers.base",
    "SingleDirectionHandler": "aiokvo.handlers.base",
    "Submission": "aiokvo.handlers.base",
    "TransferTask": "aiokvo.handlers.task",
    "OffloadingWorker": "aiokvo.handlers.worker",
    "HostOffloadingHandler": "aiokvo.handlers.host",
    "CpuGpuHandlers": "aiokvo.handlers.pair",
    "make_cpu_gpu_handlers": "aiokvo.handlers.pair",
    "compute_sub_block_ptrs": "aiokvo.handlers.plan",
    "CudaOffloadingHandler": "aiokvo.handlers.cuda.handler",
    # layout, memory
    "CanonicalKVCaches": "aiokvo.layout",
    "CanonicalKVCacheTensor": "aiokvo.layout",
    "CanonicalKVCacheRef": "aiokvo.layout",
    "SharedOffloadRegion": "aiokvo.memory.shared_region",
    "HostRegistration": "aiokvo.memory.pinned",
    "PinnedHostTensor": "aiokvo.memory.pinned",
    # wiring
    "OffloadConfig": "aiokvo.config",
    "OffloadingSpec": "aiokvo.offloading_spec",
    "CPUOffloadingSpec": "aiokvo.offloading_spec",
    "OffloadingSpecFactory": "aiokvo.factory",
}

__all__ = sorted([*_EXPORTS, "errors"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name == "errors":
            return importlib.import_module("aiokvo.errors")
        raise AttributeError(f"module 'aiokvo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from aiokvo import errors as errors
    from aiokvo.config import OffloadConfig as OffloadConfig
    from aiokvo.events import EventSubscription as EventSubscription
    from aiokvo.events import Lagged as Lagged
    from aiokvo.factory import OffloadingSpecFactory as OffloadingSpecFactory
    from aiokvo.handlers.base import OffloadingHandler as OffloadingHandler
    from aiokvo.handlers.base import SingleDirectionHandler as SingleDirectionHandler
    from aiokvo.handlers.base import Submission as Submission
    from aiokvo.handlers.cuda.handler import CudaOffloadingHandler as CudaOffloadingHandler
    from aiokvo.handlers.host import HostOffloadingHandler as HostOffloadingHandler
    from aiokvo.handlers.pair import CpuGpuHandlers as CpuGpuHandlers
    from aiokvo.handlers.pair import make_cpu_gpu_handlers as make_cpu_gpu_handlers
    from aiokvo.handlers.plan import compute_sub_block_ptrs as compute_sub_block_ptrs
    from aiokvo.handlers.task import TransferTask as TransferTask
    from aiokvo.handlers.worker import OffloadingWorker as OffloadingWorker
    from aiokvo.keys import OffloadKey as OffloadKey
    from aiokvo.keys import get_offload_block_hash as get_offload_block_hash
    from aiokvo.keys import get_offload_group_idx as get_offload_group_idx
    from aiokvo.keys import make_offload_key as make_offload_key
    from aiokvo.layout import CanonicalKVCacheRef as CanonicalKVCacheRef
    from aiokvo.layout import CanonicalKVCaches as CanonicalKVCaches
    from aiokvo.layout import CanonicalKVCacheTensor as CanonicalKVCacheTensor
    from aiokvo.manager.base import OffloadingManager as OffloadingManager
    from aiokvo.manager.cpu import CPUOffloadingManager as CPUOffloadingManager
    from aiokvo.manager.policies import ARCCachePolicy as ARCCachePolicy
    from aiokvo.manager.policies import BlockStatus as BlockStatus
    from aiokvo.manager.policies import CachePolicy as CachePolicy
    from aiokvo.manager.policies import LRUCachePolicy as LRUCachePolicy
    from aiokvo.manager.reuse import FilterReusedOffloadingManager as FilterReusedOffloadingManager
    from aiokvo.memory.pinned import HostRegistration as HostRegistration
    from aiokvo.memory.pinned import PinnedHostTensor as PinnedHostTensor
    from aiokvo.memory.shared_region import SharedOffloadRegion as SharedOffloadRegion
    from aiokvo.offloading_spec import CPUOffloadingSpec as CPUOffloadingSpec
    from aiokvo.offloading_spec import OffloadingSpec as OffloadingSpec
    from aiokvo.runtime.poller import EventPoller as EventPoller
    from aiokvo.runtime.poller import PollerMode as PollerMode
    from aiokvo.runtime.run import run as run
    from aiokvo.runtime.sources import CompletionSource as CompletionSource
    from aiokvo.runtime.sources import HostEvent as HostEvent
    from aiokvo.specs import BlockIDsLoadStoreSpec as BlockIDsLoadStoreSpec
    from aiokvo.specs import CPULoadStoreSpec as CPULoadStoreSpec
    from aiokvo.specs import GPULoadStoreSpec as GPULoadStoreSpec
    from aiokvo.specs import LoadStoreSpec as LoadStoreSpec
    from aiokvo.specs import OffloadingEvent as OffloadingEvent
    from aiokvo.specs import PrepareStoreOutput as PrepareStoreOutput
    from aiokvo.specs import ReqContext as ReqContext
    from aiokvo.specs import TransferResult as TransferResult
    from aiokvo.specs import TransferSpec as TransferSpec
    from aiokvo.specs import TransferType as TransferType
