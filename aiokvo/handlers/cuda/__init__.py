"""The CUDA backend: GPU <-> pinned CPU copies on cuda-python streams.

Only :mod:`aiokvo.device.driver` touches ``cuda.bindings``/``cuda.core``,
and lazily, so importing this package never needs a GPU. See ``docs/cuda.md``.
"""

from aiokvo.device.driver import CudaDriver, RuntimeDriver, cuda_device_count, load_driver
from aiokvo.device.fake import FakeDriver
from aiokvo.handlers.cuda.engines import DEFAULT_KERNEL_BELOW_BYTES, EngineMode, EngineName
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler, ProducerStream
from aiokvo.handlers.cuda.handles import CudaEvent
from aiokvo.handlers.cuda.pair import CudaCpuGpuHandlers, make_cuda_handlers

__all__ = [
    "DEFAULT_KERNEL_BELOW_BYTES",
    "CudaCpuGpuHandlers",
    "CudaDriver",
    "CudaEvent",
    "CudaOffloadingHandler",
    "EngineMode",
    "EngineName",
    "FakeDriver",
    "ProducerStream",
    "RuntimeDriver",
    "cuda_device_count",
    "load_driver",
    "make_cuda_handlers",
]
