"""Raw CUDA calls, below every layer that needs a device.

:mod:`aiokvo.device.driver` is the only module that calls cuda-python; every
caller speaks its narrow :class:`CudaDriver` protocol, so
:class:`~aiokvo.device.fake.FakeDriver` stands in for a GPU in CPU tests.
Importing this package never needs a GPU or cuda-python.
"""

from aiokvo.device.driver import CudaDriver, RuntimeDriver, cuda_device_count, load_driver
from aiokvo.device.fake import FakeDriver, FakeKernel

__all__ = [
    "CudaDriver",
    "FakeDriver",
    "FakeKernel",
    "RuntimeDriver",
    "cuda_device_count",
    "load_driver",
]
