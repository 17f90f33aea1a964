"""Host memory for the CPU tier: the shared offload region, CUDA pinning, and the
file-ownership rules (:mod:`aiokvo.memory.ownership`) that shared files follow."""

from aiokvo.memory.pinned import DEFAULT_MAX_CHUNK, HostRegistration, PinnedHostTensor
from aiokvo.memory.shared_region import (
    DEFAULT_DIRECTORY,
    PrefaultMethod,
    SharedOffloadRegion,
    default_directory,
)

__all__ = [
    "DEFAULT_DIRECTORY",
    "DEFAULT_MAX_CHUNK",
    "HostRegistration",
    "PinnedHostTensor",
    "PrefaultMethod",
    "SharedOffloadRegion",
    "default_directory",
]
