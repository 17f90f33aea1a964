"""The data plane: transfer handlers, the worker that routes between them, the backends.

The host backend is :mod:`aiokvo.handlers.host`; the CUDA backend lives in
:mod:`aiokvo.handlers.cuda`, which imports without a GPU and only needs one
when a handler is built over CUDA tensors.
"""

from aiokvo.handlers.base import CpuGpuHandlers, OffloadingHandler, SingleDirectionHandler
from aiokvo.handlers.host import HostOffloadingHandler, allocate_cpu_pool, make_host_handlers
from aiokvo.handlers.routes import HandlerRoute, make_cpu_gpu_handlers
from aiokvo.handlers.stats import HandlerStatistics, WorkerStatistics
from aiokvo.handlers.sync import SyncOffloadingWorker, SyncWorkerStatistics
from aiokvo.handlers.task import TransferTask
from aiokvo.handlers.worker import OffloadingWorker

__all__ = [
    "CpuGpuHandlers",
    "HandlerRoute",
    "HandlerStatistics",
    "HostOffloadingHandler",
    "OffloadingHandler",
    "OffloadingWorker",
    "SingleDirectionHandler",
    "SyncOffloadingWorker",
    "SyncWorkerStatistics",
    "TransferTask",
    "WorkerStatistics",
    "allocate_cpu_pool",
    "make_cpu_gpu_handlers",
    "make_host_handlers",
]
