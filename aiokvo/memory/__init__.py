"""Host memory for the CPU tier: the shared offload region and CUDA pinning."""

from aiokvo.memory.pinned import DEFAULT_MAX_CHUNK, HostRegistration, PinnedHostTensor
from aiokvo.memory.shared_region import DEFAULT_DIRECTORY, PrefaultMethod, SharedOffloadRegion

__all__ = [
    "DEFAULT_DIRECTORY",
    "DEFAULT_MAX_CHUNK",
    "HostRegistration",
    "PinnedHostTensor",
    "PrefaultMethod",
    "SharedOffloadRegion",
]
