"""Host memory for the CPU tier: the shared offload region (and, from ``pinned``, CUDA pinning)."""

from aiokvo.memory.shared_region import DEFAULT_DIRECTORY, PrefaultMethod, SharedOffloadRegion

__all__ = ["DEFAULT_DIRECTORY", "PrefaultMethod", "SharedOffloadRegion"]
