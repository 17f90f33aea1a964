"""What a disk-tier transfer names: blocks in slab slots, and a report of how each went.

Pure data. A :class:`DiskLoadStoreSpec` is one side of a ``(CPU, DISK)`` or
``(DISK, CPU)`` transfer: for each block its key and its
:class:`BlockLocation` (which slab, which slot, the checksum it must have,
the generation of its index entry). The handler fills the spec's
:class:`BlockReport` as blocks finish, and the tier reads it once the
transfer has ended: a transfer has one ``success``, but its blocks can fail
one by one (one corrupted block among good ones is one miss, not ten).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from aiokvo.errors import InvalidSpecError
from aiokvo.keys import OffloadKey
from aiokvo.specs import LoadStoreSpec
from aiokvo.tiers.report import BlockOutcomes

__all__ = ["DISK_MEDIUM", "BlockLocation", "BlockReport", "BlockStatus", "DiskLoadStoreSpec"]

DISK_MEDIUM = "DISK"


class BlockStatus(IntEnum):
    """How one block of a disk transfer ended."""

    NOT_RUN = 0  # the transfer stopped (an earlier error, the deadline) before this block
    OK = 1
    IO_ERROR = 2  # the system call failed (EIO, ENOSPC, ...)
    CHECKSUM = 3  # read back, and the bytes do not match the checksum: corrupt
    STALE = 4  # another process's slot now holds something else (its index moved on)
    MISSING = 5  # the file ends before the slot does (truncated, or never written)
    TIMEOUT = 6  # not started: the transfer's deadline had passed


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where a block lives: ``slot`` of slab ``slab``, with ``checksum`` (0 until written)
    and the ``generation`` of its index entry."""

    slab: int
    slot: int
    checksum: int = 0
    generation: int = 0


class BlockReport(BlockOutcomes[BlockStatus]):
    """Per-block outcome of one disk transfer (:class:`~aiokvo.tiers.report.BlockOutcomes`);
    ``checksums`` holds what a write computed for each block."""

    __slots__ = ("checksums",)

    def __init__(self, n: int) -> None:
        super().__init__(n, BlockStatus.NOT_RUN)
        self.checksums: list[int] = [0] * n


class DiskLoadStoreSpec(LoadStoreSpec):
    """Blocks of a disk tier: ``keys[i]`` at ``locations[i]``; ``report`` says how each went."""

    __slots__ = ("keys", "locations", "report")

    def __init__(
        self, keys: Sequence[OffloadKey], locations: Sequence[BlockLocation]
    ) -> None:
        if len(keys) != len(locations):
            raise InvalidSpecError(
                f"a disk spec needs one location per key: {len(keys)} keys, "
                f"{len(locations)} locations"
            )
        self.keys: tuple[OffloadKey, ...] = tuple(keys)
        self.locations: tuple[BlockLocation, ...] = tuple(locations)
        self.report = BlockReport(len(self.keys))

    @staticmethod
    def medium() -> str:
        return DISK_MEDIUM

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"DiskLoadStoreSpec({len(self.keys)} blocks)"
