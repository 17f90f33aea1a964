"""The data plane: transfer handlers, the worker that routes between them, copy plans.

The CUDA backend lives in :mod:`aiokvo.handlers.cuda`; it imports without a
GPU and only needs one when a handler is built over CUDA tensors.
"""

from aiokvo.handlers.base import OffloadingHandler, SingleDirectionHandler, Submission
from aiokvo.handlers.host import HostOffloadingHandler
from aiokvo.handlers.pair import CpuGpuHandlers, allocate_cpu_pool, make_cpu_gpu_handlers
from aiokvo.handlers.plan import compute_sub_block_ptrs, plan_copy_ptrs, plan_transfer
from aiokvo.handlers.task import TransferTask
from aiokvo.handlers.worker import OffloadingWorker

__all__ = [
    "CpuGpuHandlers",
    "HostOffloadingHandler",
    "OffloadingHandler",
    "OffloadingWorker",
    "SingleDirectionHandler",
    "Submission",
    "TransferTask",
    "allocate_cpu_pool",
    "compute_sub_block_ptrs",
    "make_cpu_gpu_handlers",
    "plan_copy_ptrs",
    "plan_transfer",
]
