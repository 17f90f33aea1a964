"""``DiskTierState``: the disk tier's decisions, with no I/O (sans-I/O, like websockets').

Calls in, decisions out, on the loop's thread, deterministic for a given
sequence of calls and clock readings:

* :meth:`lookup`: how many leading keys the tier can serve (0 while the
  breaker is open);
* :meth:`prepare_read` -> a :class:`~aiokvo.tiers.base.TierLoad` naming slots
  and checksums; :meth:`complete_read` with the handler's per-block report ->
  the keys whose bytes were good; corrupt blocks are counted, evented and
  removed, and their slots are queued to be cleared on disk
  (:meth:`take_clears`);
* :meth:`offer` (the admission filter) and :meth:`prepare_write` -> a
  :class:`~aiokvo.tiers.base.TierStore` naming slots to write (evicting by
  policy, events published); :meth:`complete_write` -> committed or released;
* :meth:`note_timeout`: a transfer ran past its deadline;
* :meth:`adopt` (the index a previous process left) and :meth:`set_foreign`
  (blocks other processes wrote to their own slabs in the same directory).

Slots of this process's slab are a :class:`~aiokvo.manager.slots.SlotManager`,
so allocation, pins and eviction are exactly the CPU manager's. Blocks of
other slabs are only indexed, never pinned: their writer may replace them at
any time, which a read detects (checksum, entry generation) as a miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from aiokvo.keys import OffloadKey
from aiokvo.manager.sink import EventSink
from aiokvo.manager.slots import SlotManager
from aiokvo.specs import ReqContext
from aiokvo.tiers.admission import Admission
from aiokvo.tiers.base import TierLoad, TierStore
from aiokvo.tiers.breaker import CircuitBreaker
from aiokvo.tiers.counters import TierCounters
from aiokvo.tiers.disk.spec import (
    DISK_MEDIUM,
    BlockLocation,
    BlockStatus,
    DiskLoadStoreSpec,
)

__all__ = ["AdoptedEntry", "DiskTierState"]

_REMOVE = (BlockStatus.CHECKSUM, BlockStatus.MISSING)
"""Read outcomes that mean the block's bytes are bad: it is dropped."""

_BREAKER_FAILURES = (BlockStatus.IO_ERROR, BlockStatus.TIMEOUT)
"""Outcomes that say the disk itself is failing (a bad block is the data's fault)."""


@dataclass(frozen=True, slots=True)
class AdoptedEntry:
    """A committed index entry found on disk: ``key`` in ``slot``."""

    slot: int
    key: OffloadKey
    checksum: int
    generation: int


@dataclass(slots=True, eq=False)
class _Ticket:
    """A transfer's private bookkeeping (``TierLoad.state`` / ``TierStore.state``)."""

    own: list[OffloadKey] = field(default_factory=list)  # keys pinned/reserved in our slab
    timed_out: bool = False
    trial: bool = False


class DiskTierState(TierCounters):
    """The disk tier's pure core: one own slab of ``num_slots`` slots plus foreign slabs.

    ``slab`` is the number of this process's slab; ``sink`` receives the
    tier's events (medium ``"DISK"``).
    """

    def __init__(
        self,
        num_slots: int,
        *,
        slab: int = 0,
        policy: str = "lru",
        admit_after: int = 1,
        max_tracked: int = 64_000,
        breaker: CircuitBreaker | None = None,
        sink: EventSink | None = None,
    ) -> None:
        super().__init__()
        self.slots = SlotManager(num_slots, policy, medium=DISK_MEDIUM, sink=sink)
        self.slab = slab
        self.admission = Admission(admit_after, max_tracked)
        self.breaker = breaker or CircuitBreaker()
        self._own: dict[OffloadKey, tuple[int, int]] = {}  # committed: checksum, generation
        self._foreign: dict[OffloadKey, BlockLocation] = {}
        self._clears: list[tuple[int, int]] = []  # (slot, generation) to clear on disk
        self._next_generation = 1
        # Counters beyond TierCounters' (see DiskTierStatistics).
        self.checksum_failures = self.stale_reads = 0

    # ---------------------------------------------------------------- views
    @property
    def num_slots(self) -> int:
        return self.slots.num_blocks

    @property
    def foreign_blocks(self) -> int:
        """Blocks indexed from other processes' slabs (not held by ours)."""
        return len(self._foreign)

    def holds(self, key: OffloadKey) -> bool:
        """``key`` is readable from the tier now (ours, or another slab's)."""
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

    # -------------------------------------------------------------- lookups
    def lookup(self, keys: Sequence[OffloadKey], now: float) -> int:
        """How many leading ``keys`` are readable; 0 while the breaker is open."""
        self.lookups += 1
        if not self.breaker.available(now):
            self.lookups_bypassed += 1
            return 0
        ready, foreign = self.slots.is_ready, self._foreign
        n = 0
        for key in keys:
            if not (ready(key) or key in foreign):
                self.lookup_misses += 1
                break
            n += 1
        self.lookup_hits += n
        return n

    # ---------------------------------------------------------------- reads
    def prepare_read(self, keys: Sequence[OffloadKey], now: float) -> TierLoad | None:
        """Pin readable ``keys`` (ours; others' are only located), or None.

        None when a key is not readable (nothing is pinned) or the breaker
        turns the read away.
        """
        locations: list[BlockLocation] = []
        own: list[OffloadKey] = []
        for key in keys:
            where = self.location(key)
            if where is None:
                return None
            locations.append(where)
            if where.slab == self.slab:
                own.append(key)
        if not keys or not self.breaker.acquire(now):
            return None
        ticket = _Ticket(own=own, trial=self.breaker.state(now) == "half_open")
        if own:
            self.slots.prepare_load(own, _CTX)
            self.slots.touch(own)
        return TierLoad(list(keys), DiskLoadStoreSpec(keys, locations), ticket)

    def complete_read(
        self, load: TierLoad, *, now: float, nbytes: int = 0, seconds: float = 0.0
    ) -> list[OffloadKey]:
        """The read of ``load`` ended (its spec's report says how); the good keys.

        Unpins our slots; blocks that read back corrupt or truncated are
        counted and removed (an event for ours, and their entries queued for
        clearing); another slab's block that moved on is a stale miss.
        """
        ticket: _Ticket = load.state
        spec = load.spec
        assert isinstance(spec, DiskLoadStoreSpec)
        report = spec.report
        if ticket.own:
            self.slots.complete_load(ticket.own)
        good: list[OffloadKey] = []
        bad_own: list[OffloadKey] = []
        disk_failed = False
        for key, where, status in zip(spec.keys, spec.locations, report.status, strict=True):
            if status is BlockStatus.OK:
                good.append(key)
                continue
            self.read_failures += 1
            if status in _BREAKER_FAILURES:
                disk_failed = True
            if status is BlockStatus.STALE:
                self.stale_reads += 1
            elif status is BlockStatus.CHECKSUM:
                self.checksum_failures += 1
            if status in _REMOVE or status is BlockStatus.STALE:
                if where.slab == self.slab:
                    bad_own.append(key)
                elif self._foreign.get(key) == where:
                    del self._foreign[key]
        if bad_own:
            self._remove_own(bad_own)
        self.reads += 1
        self.blocks_read += len(good)
        self.bytes_read += nbytes
        self.read_seconds += seconds
        self._record(ticket, failed=disk_failed, now=now)
        return good

    def _remove_own(self, keys: Sequence[OffloadKey]) -> None:
        where = {key: self.slots.slot_of(key) for key in keys}
        for key in self.slots.remove(keys):
            committed = self._own.pop(key, None)
            slot = where[key]
            if committed is not None and slot is not None:
                self._clears.append((slot, committed[1]))

    # --------------------------------------------------------------- writes
    def offer(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        """Count an offer of each key; those admitted that the tier does not hold.

        Nothing is admitted while the breaker is open (counted as refused).
        """
        self.offers += len(keys)
        if not self.breaker.available(now):
            self.breaker.reject()
            self.writes_refused += len(keys)
            return []
        admitted = self.admission.offer(keys)
        slot_of, foreign = self.slots.slot_of, self._foreign
        wanted = [k for k in admitted if slot_of(k) is None and k not in foreign]
        self.admitted += len(wanted)
        return wanted

    def prepare_write(self, keys: Sequence[OffloadKey], now: float) -> TierStore | None:
        """Reserve slots for the ``keys`` not held (evicting by policy), or None.

        None when there is nothing to write, no room even after eviction (or
        more keys than slots), or the breaker turns the write away.
        """
        slots = self.slots
        new = [k for k in dict.fromkeys(keys) if slots.slot_of(k) is None]
        if not new:
            return None
        if len(new) > slots.num_blocks or not self._room_for(len(new)):
            self.writes_refused += len(new)
            return None
        if not self.breaker.acquire(now):
            self.writes_refused += len(new)
            return None
        trial = self.breaker.state(now) == "half_open"
        out = slots.prepare_store(new, _CTX)
        assert out is not None and out.keys_to_store == new
        for key in out.evicted_keys:
            self._own.pop(key, None)
        ids = slots_ids(out.store_spec)
        locations = []
        for slot in ids:
            locations.append(BlockLocation(self.slab, slot, 0, self._next_generation))
            self._next_generation += 1
        spec = DiskLoadStoreSpec(new, locations)
        return TierStore(list(new), spec, list(out.evicted_keys), _Ticket(own=new, trial=trial))

    def _room_for(self, n: int) -> bool:
        """Whether ``n`` slots can be had (free, or idle keys to evict)."""
        slots = self.slots
        stats = slots.statistics()
        idle = stats.used_blocks - stats.writing_blocks - stats.pinned_blocks
        return stats.free_blocks + idle >= n

    def complete_write(
        self, store: TierStore, *, now: float, nbytes: int = 0, seconds: float = 0.0
    ) -> list[OffloadKey]:
        """The write of ``store`` ended: committed blocks become readable (an event),
        the rest are released. Returns the committed keys."""
        ticket: _Ticket = store.state
        spec = store.spec
        assert isinstance(spec, DiskLoadStoreSpec)
        report = spec.report
        done: list[OffloadKey] = []
        failed: list[OffloadKey] = []
        disk_failed = False
        for key, where, status, checksum in zip(
            spec.keys, spec.locations, report.status, report.checksums, strict=True
        ):
            if status is BlockStatus.OK:
                done.append(key)
                self._own[key] = (checksum, where.generation)
            else:
                failed.append(key)
                if status in _BREAKER_FAILURES:
                    disk_failed = True
        if failed:
            self.slots.complete_store(failed, success=False)
        if done:
            self.slots.complete_store(done, success=True)
        self.writes += 1
        self.blocks_written += len(done)
        self.write_failures += len(failed)
        self.bytes_written += nbytes
        self.write_seconds += seconds
        self._record(ticket, failed=disk_failed, now=now)
        store.written = done
        return done

    # ------------------------------------------------------------- liveness
    def note_timeout(self, ticket: object, now: float) -> None:
        """A transfer of ``ticket`` (a TierLoad's or TierStore's ``state``) is past
        its deadline: count it, and count it against the breaker once."""
        assert isinstance(ticket, _Ticket)
        if ticket.timed_out:
            return
        ticket.timed_out = True
        self.timeouts += 1
        self.breaker.record_failure(now)

    def _record(self, ticket: _Ticket, *, failed: bool, now: float) -> None:
        if ticket.timed_out:
            return  # counted when the deadline passed; a late outcome changes nothing
        if failed:
            self.breaker.record_failure(now)
        else:
            self.breaker.record_success(now)

    # --------------------------------------------------- what disks hold
    def adopt(self, entries: Iterable[AdoptedEntry]) -> list[AdoptedEntry]:
        """Start from the committed entries of our slab (before any other call).

        A key found twice keeps its newest entry; the older ones, and entries
        past the last slot, are returned (their slots are to be cleared).
        """
        newest: dict[OffloadKey, AdoptedEntry] = {}
        dropped: list[AdoptedEntry] = []
        for entry in sorted(entries, key=lambda e: e.generation):
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
        top = max((e.generation for e in (*kept, *dropped)), default=0)
        self._next_generation = top + 1
        return dropped

    def set_foreign(self, blocks: Mapping[OffloadKey, BlockLocation]) -> None:
        """Replace the index of other slabs' blocks (after a refresh)."""
        self._foreign = {k: v for k, v in blocks.items() if v.slab != self.slab}

    def take_clears(self) -> list[tuple[int, int]]:
        """``(slot, generation)`` of entries to clear on disk (removed blocks), once."""
        clears, self._clears = self._clears, []
        return clears


_CTX = ReqContext()  # the slot manager ignores request contexts


def slots_ids(spec: object) -> list[int]:
    """The slot ids of a spec the slot manager made."""
    block_ids = getattr(spec, "block_ids", None)
    assert block_ids is not None
    return [int(i) for i in block_ids.tolist()]
