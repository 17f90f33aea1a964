"""The local disk tier: slabs of checksummed blocks under a layout-fingerprint directory.

``DiskTier`` is what the Offloader is handed; ``DiskTierConfig`` its settings
(also from ``OffloadConfig.from_dict``); the pure core is
:mod:`aiokvo.tiers.disk.state` (importable without asyncio or torch, like
the rest of the pure part: ``config``, ``spec``). See docs/tiers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiokvo._util import lazy_export
from aiokvo.tiers.disk.config import DiskTierConfig
from aiokvo.tiers.disk.spec import DiskLoadStoreSpec

if TYPE_CHECKING:
    from aiokvo.tiers.disk.files import FileIO
    from aiokvo.tiers.disk.tier import DiskTier, DiskTierStatistics

__all__ = ["DiskLoadStoreSpec", "DiskTier", "DiskTierConfig", "DiskTierStatistics", "FileIO"]

_LAZY = {
    "DiskTier": "aiokvo.tiers.disk.tier",
    "DiskTierStatistics": "aiokvo.tiers.disk.tier",
    "FileIO": "aiokvo.tiers.disk.files",
}


def __getattr__(name: str) -> Any:
    return lazy_export(globals(), _LAZY, name)
