"""The local disk tier: slabs of checksummed blocks under a layout-fingerprint directory.

``DiskTier(...)`` makes what the Offloader is handed (a
:class:`~aiokvo.tiers.engine.StoreTier` over a
:class:`~aiokvo.tiers.disk.store.DiskStore`); ``DiskTierConfig`` is its
settings (also from ``OffloadConfig.from_dict``). The pure parts (``config``,
``spec``, and the :class:`~aiokvo.tiers.slot_index.SlotIndex` it places
blocks with) import without asyncio or torch. See docs/tiers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiokvo._util import lazy_export
from aiokvo.tiers.disk.config import DiskTierConfig
from aiokvo.tiers.disk.spec import DiskLoadStoreSpec

if TYPE_CHECKING:
    from aiokvo.tiers.disk.files import FileIO
    from aiokvo.tiers.disk.store import DiskStore, DiskTierStatistics
    from aiokvo.tiers.disk.tier import DiskTier

__all__ = [
    "DiskLoadStoreSpec", "DiskStore", "DiskTier", "DiskTierConfig", "DiskTierStatistics", "FileIO",
]  # fmt: skip

_LAZY = {
    "DiskStore": "aiokvo.tiers.disk.store",
    "DiskTier": "aiokvo.tiers.disk.tier",
    "DiskTierStatistics": "aiokvo.tiers.disk.store",
    "FileIO": "aiokvo.tiers.disk.files",
}


def __getattr__(name: str) -> Any:
    return lazy_export(globals(), _LAZY, name)
