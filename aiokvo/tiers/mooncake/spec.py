"""What a Mooncake transfer names: blocks as cluster objects, and how each one went.

Pure data. A :class:`MooncakeLoadStoreSpec` is the cluster side of a
``(CPU, MOONCAKE)`` or ``(MOONCAKE, CPU)`` transfer: for each block its key
and its object name in the cluster. The handler fills the spec's
:class:`BlockReport` while the transfer runs (the return code Mooncake gave
each object, and what that means), and the tier reads it once the transfer
has ended: a batch call answers per object, so one vanished block among good
ones is one miss, never ten.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

from aiokvo.errors import InvalidSpecError
from aiokvo.keys import OffloadKey
from aiokvo.specs import LoadStoreSpec
from aiokvo.tiers.report import BlockOutcomes

__all__ = ["MOONCAKE_MEDIUM", "BlockReport", "BlockStatus", "MooncakeLoadStoreSpec"]

MOONCAKE_MEDIUM = "MOONCAKE"


class BlockStatus(IntEnum):
    """How one block of a Mooncake transfer ended (the codes are Mooncake's ``ErrorCode``)."""

    NOT_RUN = 0  # the call never ran (the transfer failed before it, or was never submitted)
    OK = 1
    NOT_FOUND = 2  # -704: the object is gone (evicted, or its segment left the cluster)
    LEASE_EXPIRED = 3  # -707: its read lease ran out before the transfer finished
    TRANSFER_FAILED = 4  # -800: the segment holding it (or the one chosen for it) is unreachable
    NO_SPACE = 5  # -200: the cluster had no room for a put
    RPC_FAILED = 6  # -900, -901, -1: the master did not answer (or failed)
    SIZE_MISMATCH = 7  # the object is not the size this layout's block has (-600, or a short read)
    BAD_TRAILER = 8  # the object's trailer is not this block's (fingerprint, key, length, seal)
    CHECKSUM = 9  # the payload read back does not match the checksum its writer stored
    TIMEOUT = 10  # the deadline had passed before the call could start
    ERROR = 11  # any other failure (another negative code, an exception in the call)


FAILED_CALL = frozenset({BlockStatus.RPC_FAILED, BlockStatus.TIMEOUT})
"""Outcomes that say the cluster itself is failing (they count against the breaker)."""

BAD_OBJECT = frozenset({BlockStatus.BAD_TRAILER, BlockStatus.CHECKSUM})
"""Outcomes that say the object under our name holds wrong bytes (it is removed)."""

STALE_EXISTS = frozenset(
    {BlockStatus.NOT_FOUND, BlockStatus.TRANSFER_FAILED, BlockStatus.SIZE_MISMATCH, *BAD_OBJECT}
)
"""Read outcomes after which the cluster's "exists" answer is not trusted for a while
(the negative cache): asking again soon would only repeat a doomed get."""


class BlockReport(BlockOutcomes[BlockStatus]):
    """Per-block outcome of one Mooncake transfer (:class:`~aiokvo.tiers.report.BlockOutcomes`);
    ``codes`` holds what Mooncake returned for each object (bytes read, 0, or a
    negative ``ErrorCode``)."""

    __slots__ = ("codes",)

    def __init__(self, n: int) -> None:
        super().__init__(n, BlockStatus.NOT_RUN)
        self.codes: list[int] = [0] * n


class MooncakeLoadStoreSpec(LoadStoreSpec):
    """Blocks in a Mooncake cluster: ``keys[i]`` is the object ``names[i]``.

    ``report`` says how each went once the transfer has ended.
    """

    __slots__ = ("keys", "names", "report")

    def __init__(self, keys: Sequence[OffloadKey], names: Sequence[str]) -> None:
        if len(keys) != len(names):
            raise InvalidSpecError(
                f"a Mooncake spec needs one object name per key: {len(keys)} keys, "
                f"{len(names)} names"
            )
        self.keys: tuple[OffloadKey, ...] = tuple(keys)
        self.names: tuple[str, ...] = tuple(names)
        self.report = BlockReport(len(self.keys))

    @staticmethod
    def medium() -> str:
        return MOONCAKE_MEDIUM

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"MooncakeLoadStoreSpec({len(self.keys)} blocks)"
