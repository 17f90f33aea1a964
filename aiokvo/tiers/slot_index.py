"""``SlotIndex``: placement for stores that place blocks themselves (the disk tier).

The store has a fixed number of equal slots in files this process writes
(its *slab*), and may also read slabs other processes write in the same
directory. Slots of our slab are a :class:`~aiokvo.manager.slots.SlotManager`,
so allocation, pins and eviction are exactly the CPU manager's (LRU, ARC, a
module path). Blocks of other slabs are only indexed, never pinned: their
writer may replace them at any time, which a read detects (checksum, entry
generation) as a ``STALE`` or ``CORRUPT`` miss.

A block's place is a :class:`BlockLocation`: slab, slot, the checksum it must
have and the generation of its index entry (a slot reused gets a new one).
Removed blocks of our slab are queued as ``(slot, generation)`` for the store
to clear (:meth:`SlotIndex.take_removals`). Pure and synchronous.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import Any, NamedTuple

from aiokvo.keys import OffloadKey
from aiokvo.manager.sink import EventSink
from aiokvo.manager.slots import SlotManager
from aiokvo.specs import ReqContext
from aiokvo.tiers.index import Reservation
from aiokvo.tiers.outcome import Outcome, Outcomes

__all__ = ["AdoptedEntry", "Adoption", "BlockLocation", "SlotIndex"]

_DROP = frozenset({Outcome.CORRUPT, Outcome.MISSING, Outcome.STALE})
"""Read outcomes after which the block is not read from that place again."""

_CTX = ReqContext()  # the slot manager ignores request contexts


class BlockLocation(NamedTuple):
    """Where a block lives: ``slot`` of slab ``slab``, with ``checksum`` (0 until written)
    and the ``generation`` of its index entry. A named tuple: one is made per block of
    every transfer, on the loop, at a third of a frozen dataclass's cost."""

    slab: int
    slot: int
    checksum: int = 0
    generation: int = 0


_new_location = partial(tuple.__new__, BlockLocation)
"""``BlockLocation`` from a ``(slab, slot, checksum, generation)`` tuple, in C (the named
tuple's own ``__new__`` is a Python function)."""


@dataclass(frozen=True, slots=True)
class AdoptedEntry:
    """A committed index entry found in our slab at open: ``key`` in ``slot``."""

    slot: int
    key: OffloadKey
    checksum: int
    generation: int


@dataclass(frozen=True, slots=True)
class Adoption:
    """What a store found at open: the number of the slab it writes, and that slab's
    committed entries (a previous process's)."""

    slab: int
    entries: tuple[AdoptedEntry, ...] = ()


class SlotIndex:
    """``num_slots`` slots of our slab (number ``slab``) plus other slabs' blocks.

    ``policy`` is the eviction policy; ``sink`` receives the tier's events
    (medium ``medium``).
    """

    def __init__(
        self,
        num_slots: int,
        *,
        medium: str,
        slab: int = 0,
        policy: str = "lru",
        sink: EventSink | None = None,
    ) -> None:
        self.slots = SlotManager(num_slots, policy, medium=medium, sink=sink)
        self.slab = slab
        self._own: dict[OffloadKey, tuple[int, int]] = {}  # committed: checksum, generation
        self._foreign: dict[OffloadKey, BlockLocation] = {}
        self._clears: list[tuple[int, int]] = []  # (slot, generation) to clear in the store
        self._next_generation = 1
        self.adopted_blocks = 0  # kept by adopt(): duplicates and strays not counted

    # ---------------------------------------------------------------- views
    @property
    def num_slots(self) -> int:
        return self.slots.num_blocks

    @property
    def capacity_blocks(self) -> int:
        return self.slots.num_blocks

    @property
    def used_blocks(self) -> int:
        return self.slots.statistics().used_blocks

    @property
    def evictions(self) -> int:
        return self.slots.statistics().blocks_evicted

    @property
    def removals(self) -> int:
        return self.slots.blocks_removed

    @property
    def foreign_blocks(self) -> int:
        """Blocks indexed from other processes' slabs (not held by ours)."""
        return len(self._foreign)

    def holds(self, key: OffloadKey) -> bool:
        """``key`` is readable now (ours, or another slab's)."""
        return self.slots.is_ready(key) or key in self._foreign

    def location(self, key: OffloadKey) -> BlockLocation | None:
        """Where a readable ``key`` is (our slab first)."""
        if self.slots.is_ready(key):
            checksum, generation = self._own[key]
            slot = self.slots.slot_of(key)
            assert slot is not None
            return BlockLocation(self.slab, slot, checksum, generation)
        return self._foreign.get(key)

    def foreign(self) -> dict[OffloadKey, BlockLocation]:
        """A copy of the index of other slabs' blocks."""
        return dict(self._foreign)

    def own_keys(self) -> list[OffloadKey]:
        """Committed keys of our slab."""
        return list(self._own)

    def statistics_extra(self, now: float) -> dict[str, Any]:
        return {"foreign_blocks": len(self._foreign), "adopted_blocks": self.adopted_blocks}

    # -------------------------------------------------------------- lookups
    def lookup(self, keys: Sequence[OffloadKey], now: float) -> int:
        ready, foreign = self.slots.is_ready, self._foreign
        n = 0
        for key in keys:
            if not (ready(key) or key in foreign):
                break
            n += 1
        return n

    def wants(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        slot_of, foreign = self.slots.slot_of, self._foreign
        return [k for k in dict.fromkeys(keys) if slot_of(k) is None and k not in foreign]

    # ---------------------------------------------------------------- reads
    def reserve_read(self, keys: Sequence[OffloadKey], now: float) -> Reservation | None:
        if not keys:
            return None
        locations: list[BlockLocation] = []
        own: list[OffloadKey] = []
        committed, ready, slot_of = self._own.get, self.slots.is_ready, self.slots.slot_of
        foreign, slab = self._foreign, self.slab
        for key in keys:  # as location(), inlined: this runs per block of a promotion
            entry = committed(key)
            slot = None if entry is None else slot_of(key)
            if entry is not None and slot is not None and ready(key):
                locations.append(BlockLocation(slab, slot, entry[0], entry[1]))
                own.append(key)
                continue
            where = foreign.get(key)
            if where is None:
                return None
            locations.append(where)
        if own:
            self.slots.prepare_load(own, _CTX)
            self.slots.touch(own)
        return Reservation(list(keys), list(locations), state=own)

    # --------------------------------------------------------------- writes
    def reserve_write(self, keys: Sequence[OffloadKey], now: float) -> Reservation | None:
        slots = self.slots
        new = [k for k in dict.fromkeys(keys) if slots.slot_of(k) is None]
        if not new or len(new) > slots.num_blocks or not self._room_for(len(new)):
            return None
        out = slots.prepare_store(new, _CTX)
        assert out is not None and out.keys_to_store == new
        for key in out.evicted_keys:
            self._own.pop(key, None)
        block_ids = getattr(out.store_spec, "block_ids", None)
        assert block_ids is not None
        placed: list[int] = block_ids.tolist()
        first = self._next_generation
        self._next_generation = first + len(placed)
        # One location per block, built without a Python call per block (a write of
        # 2048 blocks spent 1.3-4 ms of the loop here, one BlockLocation() at a time).
        locations = list(map(_new_location, zip(
            repeat(self.slab), placed, repeat(0), range(first, first + len(placed))
        )))  # fmt: skip
        return Reservation(new, locations, list(out.evicted_keys), state=new)

    def _room_for(self, n: int) -> bool:
        """Whether ``n`` slots can be had (free, or idle keys to evict)."""
        stats = self.slots.statistics()
        idle = stats.used_blocks - stats.writing_blocks - stats.pinned_blocks
        return stats.free_blocks + idle >= n

    # --------------------------------------------------------------- commit
    def commit(
        self, reservation: Reservation, outcomes: Outcomes, *, write: bool, now: float
    ) -> list[OffloadKey]:
        if write:
            return self._commit_write(reservation, outcomes)
        own: list[OffloadKey] = reservation.state
        if own:
            self.slots.complete_load(own)
        if outcomes.all_ok():
            return list(reservation.keys)
        good: list[OffloadKey] = []
        bad_own: list[OffloadKey] = []
        for key, where, status in zip(
            reservation.keys, reservation.where, outcomes.status, strict=True
        ):
            if status is Outcome.OK:
                good.append(key)
            elif status in _DROP:
                if where.slab == self.slab:
                    bad_own.append(key)
                elif self._foreign.get(key) == where:
                    del self._foreign[key]
        if bad_own:
            self._remove_own(bad_own)
        return good

    def _commit_write(self, reservation: Reservation, outcomes: Outcomes) -> list[OffloadKey]:
        done: list[OffloadKey] = []
        failed: list[OffloadKey] = []
        for key, where, status, checksum in zip(
            reservation.keys, reservation.where, outcomes.status, outcomes.checksums, strict=True
        ):
            if status is Outcome.OK:
                done.append(key)
                self._own[key] = (checksum, where.generation)
            else:
                failed.append(key)
        if failed:
            self.slots.complete_store(failed, success=False)
        if done:
            self.slots.complete_store(done, success=True)
        return done

    def _remove_own(self, keys: Sequence[OffloadKey]) -> None:
        where = {key: self.slots.slot_of(key) for key in keys}
        for key in self.slots.remove(keys):
            committed = self._own.pop(key, None)
            slot = where[key]
            if committed is not None and slot is not None:
                self._clears.append((slot, committed[1]))

    def take_removals(self) -> list[Any]:
        clears, self._clears = self._clears, []
        return clears

    def distrust(self, now: float) -> None:
        """A disk does not forget what it holds when it fails: nothing to do."""

    # --------------------------------------------------- what disks hold
    def adopt(self, found: Any) -> list[Any]:
        """Start from what the store found at open (an :class:`Adoption`): our slab and
        its committed entries.

        A key found twice keeps its newest entry; the older ones, and entries
        past the last slot, are dropped; those in a slot are returned as ``(slot,
        generation)`` to clear.
        """
        assert isinstance(found, Adoption)
        self.slab = found.slab
        newest: dict[OffloadKey, AdoptedEntry] = {}
        dropped: list[AdoptedEntry] = []
        for entry in sorted(found.entries, key=lambda e: e.generation):
            if entry.slot >= self.num_slots:
                dropped.append(entry)
                continue
            old = newest.pop(entry.key, None)
            if old is not None:
                dropped.append(old)
            newest[entry.key] = entry  # re-inserted last: newest order kept
        kept = list(newest.values())
        self.slots.adopt([e.key for e in kept], [e.slot for e in kept])
        self._own = {e.key: (e.checksum, e.generation) for e in kept}
        self.adopted_blocks = len(kept)
        top = max((e.generation for e in (*kept, *dropped)), default=0)
        self._next_generation = top + 1
        return [(e.slot, e.generation) for e in dropped if e.slot < self.num_slots]

    def set_foreign(self, blocks: Mapping[OffloadKey, BlockLocation]) -> None:
        """Replace the index of other slabs' blocks (after a refresh)."""
        self._foreign = {k: v for k, v in blocks.items() if v.slab != self.slab}
