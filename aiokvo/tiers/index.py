"""``Index``: where a tier's keys live and what an outcome means (pure).

The engine (:class:`~aiokvo.tiers.engine.StoreTier`) asks its index every
question about placement and hands it every transfer's outcomes; the index
never does I/O. Two serve every store:

* :class:`~aiokvo.tiers.slot_index.SlotIndex`, for stores that place blocks
  themselves (the disk tier: slots allocated and evicted by the CPU
  manager's pool and policies, plus what other processes' slabs hold);
* :class:`~aiokvo.tiers.seen_index.SeenIndex`, for stores whose cluster
  places blocks (Mooncake, any Redis, S3 or object store): what it has seen
  there, and a negative cache of what it found missing.

Every call takes ``now`` (seconds on any monotonic clock), so a test drives
an index with a fake clock and gets the same decisions every time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokvo.keys import OffloadKey
from aiokvo.tiers.outcome import Outcomes

__all__ = ["Index", "RemoteIndex", "Reservation"]


@dataclass(slots=True, eq=False)
class Reservation:
    """What an index reserved for one transfer: ``keys``, ``where`` each is (for the
    store), ``evicted`` keys dropped to make room; ``state`` is the index's own."""

    keys: list[OffloadKey]
    where: list[Any]
    evicted: list[OffloadKey] = field(default_factory=list)
    state: Any = None


class Index(Protocol):
    """The pure placement part of a tier; see the module."""

    @property
    def capacity_blocks(self) -> int:
        """Blocks the index can place (0: the store places them)."""
        ...

    @property
    def used_blocks(self) -> int:
        """Blocks held (ready or being written), as far as the index knows."""
        ...

    @property
    def evictions(self) -> int:
        """Blocks evicted to make room so far."""
        ...

    @property
    def removals(self) -> int:
        """Blocks dropped for bad bytes so far."""
        ...

    def lookup(self, keys: Sequence[OffloadKey], now: float) -> int:
        """How many leading ``keys`` are readable, from what the index knows."""
        ...

    def wants(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        """Of ``keys`` (each once, in order), those worth writing: not held, not in flight."""
        ...

    def reserve_read(self, keys: Sequence[OffloadKey], now: float) -> Reservation | None:
        """Pin ``keys`` for reading (None, nothing pinned, if one is not readable)."""
        ...

    def reserve_write(self, keys: Sequence[OffloadKey], now: float) -> Reservation | None:
        """Place ``keys`` (from :meth:`wants`) for writing, evicting if needed; None: no room."""
        ...

    def commit(
        self, reservation: Reservation, outcomes: Outcomes, *, write: bool, now: float
    ) -> list[OffloadKey]:
        """The transfer of ``reservation`` ended as ``outcomes`` say: release it; the keys
        that are good (a read) or committed (a write). Publishes the tier's events."""
        ...

    def adopt(self, found: Any) -> list[Any]:
        """Start from what the store held at open (before any other call); returns
        what the store should remove (duplicates, leftovers)."""
        ...

    def take_removals(self) -> list[Any]:
        """Places holding bad bytes, for the store to remove (each once)."""
        ...

    def distrust(self, now: float) -> None:
        """The store may have lost what it held (a reconnection, a tripped breaker)."""
        ...

    def statistics_extra(self, now: float) -> dict[str, Any]:
        """The index's own counters, as fields of the tier's statistics."""
        ...


class RemoteIndex(Index, Protocol):
    """An index over a store that answers "which of these exist?" (a remote lookup)."""

    def place_of(self, key: OffloadKey) -> Any:
        """Where the store keeps ``key`` (what its ``exists`` is asked about)."""
        ...

    def to_ask(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        """The leading keys to ask the store about (those before the first it knows
        to be missing)."""
        ...

    def answered(
        self, asked: Sequence[OffloadKey], answers: Sequence[int] | None, now: float
    ) -> int:
        """The store's ``answers`` (1: exists) for ``asked`` (None: the call failed);
        how many leading keys exist."""
        ...
