"""What a disk-tier transfer names: blocks in slab slots (pure data).

A :class:`DiskLoadStoreSpec` is the disk side of a ``(CPU, DISK)`` or
``(DISK, CPU)`` transfer: for each block its key and its
:class:`~aiokvo.tiers.slot_index.BlockLocation` (which slab, which slot, the
checksum it must have, the generation of its index entry), and the
:class:`~aiokvo.tiers.outcome.Outcomes` the store fills.
"""

from __future__ import annotations

from aiokvo.tiers.slot_index import BlockLocation
from aiokvo.tiers.spec import TierSpec

__all__ = ["DISK_MEDIUM", "BlockLocation", "DiskLoadStoreSpec"]

DISK_MEDIUM = "DISK"


class DiskLoadStoreSpec(TierSpec):
    """Blocks of a disk tier: ``keys[i]`` at ``where[i]`` (a ``BlockLocation``)."""

    __slots__ = ()
    MEDIUM = DISK_MEDIUM
