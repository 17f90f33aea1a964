"""The Offloader: an async scheduler's whole offloading workflow as single awaitable calls.

See :class:`Offloader` and docs/offloader.md.
"""

from aiokvo.offloader.blocks import GpuBlockIds
from aiokvo.offloader.core import Offloader
from aiokvo.offloader.lease import PrefixLease
from aiokvo.offloader.results import OffloaderStatistics, StoreResult

__all__ = ["GpuBlockIds", "Offloader", "OffloaderStatistics", "PrefixLease", "StoreResult"]
