"""What the Offloader reports: one :class:`StoreResult` per store, and its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokvo.handlers.stats import WorkerStatistics
from aiokvo.keys import OffloadKey
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.offloader.control import ControlStatistics
from aiokvo.runtime.poller import PollerStatistics
from aiokvo.tiers.base import TierStatistics

__all__ = ["OffloaderStatistics", "StoreResult"]


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What one :meth:`Offloader.store <aiokvo.Offloader.store>` did with its keys.

    * ``stored``: reserved, copied, and now readable;
    * ``skipped``: not written by this call: already held (ready, or being
      written by another store), held back by the reuse filter, or listed twice;
    * ``evicted``: other keys dropped from the pool to make room;
    * ``refused``: every key of the call, when the pool could not make room
      for them at all (every block it could evict is held by a store being
      written, a load, a lease or a tier write in flight): nothing was
      copied, and the same store may succeed once blocks free up;
    * ``failed``: reserved but the copy failed (released again, never readable).

    Keys appear in call order, each once.
    """

    stored: tuple[OffloadKey, ...] = ()
    skipped: tuple[OffloadKey, ...] = ()
    evicted: tuple[OffloadKey, ...] = ()
    failed: tuple[OffloadKey, ...] = ()
    refused: tuple[OffloadKey, ...] = ()

    @property
    def ok(self) -> bool:
        """True when nothing failed or was refused (skipped keys are not failures)."""
        return not self.failed and not self.refused


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloaderStatistics:
    """An Offloader's own counters, its work in flight, and its parts' snapshots.

    The Offloader counts only what only it knows (calls, waits, leases, where
    hits came from); each part counts its own work once: the CPU pool in
    ``manager``, the copies in ``worker`` (every handler), each tier's reads,
    writes and failures in ``tiers``. Keys are counted once per call that
    named them.
    """

    loads: int = 0
    """``load_prefix`` calls."""
    leases: int = 0
    """``pin_prefix`` calls that pinned something."""
    active_leases: int = 0
    """Leases holding pins now."""
    hit_blocks: int = 0
    """Keys found ready and pinned by a load or a lease (from any tier)."""
    miss_blocks: int = 0
    """Keys ``load_prefix`` asked for past the ready prefix."""
    blocks_loaded: int = 0
    """Keys whose copy to the GPU succeeded."""
    blocks_load_failed: int = 0
    """Keys whose copy to the GPU failed."""
    store_waits: int = 0
    """Times a load waited for a store of its prefix in flight."""
    polled_waits: int = 0
    """Times a load polled for a store the Offloader did not make (one made by hand)."""
    stores: int = 0
    """``store`` calls."""
    stores_refused: int = 0
    """``store`` calls that found no room in the pool."""
    blocks_stored: int = 0
    """Keys stored (the calls' ``StoreResult.stored``)."""
    blocks_skipped: int = 0
    """Keys skipped (``StoreResult.skipped``)."""
    blocks_evicted: int = 0
    """Keys evicted to make room (``StoreResult.evicted``)."""
    blocks_store_failed: int = 0
    """Keys whose store failed (``StoreResult.failed``)."""
    blocks_store_refused: int = 0
    """Keys refused a slot: the pool could not make room (``StoreResult.refused``)."""
    load_transfers: int = 0
    """Copies to the GPU finished."""
    load_transfer_failures: int = 0
    """Copies to the GPU that failed."""
    load_bytes: int = 0
    """Bytes of the successful copies to the GPU."""
    load_seconds: float = 0.0
    """Copy time of the successful copies to the GPU, summed."""
    store_transfers: int = 0
    """Copies from the GPU finished."""
    store_transfer_failures: int = 0
    """Copies from the GPU that failed."""
    store_bytes: int = 0
    """Bytes of the successful copies from the GPU."""
    store_seconds: float = 0.0
    """Copy time of the successful copies from the GPU, summed."""
    loads_in_flight: int = 0
    """Copies to the GPU not finished now."""
    stores_in_flight: int = 0
    """Copies from the GPU not finished now."""
    writing_keys: int = 0
    """Keys those stores are writing now."""
    waiters: int = 0
    """Coroutines waiting now in ``ready`` or for a store in ``load_prefix``."""
    cancelled_waits: int = 0
    """Calls cancelled while their copy went on."""
    closed: bool = False
    """``aclose()`` has begun."""
    hits_by_medium: dict[str, int] = field(default_factory=dict)
    """``hit_blocks`` by where the block was found: ``"CPU"``, or the tier that promoted it."""
    promotion_timeouts: int = 0
    """Promotions a load stopped waiting for, past their tier's ``io_timeout``."""
    promotions_no_room: int = 0
    """Promotions not started: the pool had no room left for them once the tier answered."""
    tier_writes_skipped: int = 0
    """Keys not written through because a tier's writes in flight pinned its share of the pool."""
    tiers: tuple[TierStatistics, ...] = ()
    """Each tier's own snapshot (its reads are the promotions, its writes the
    write-through), top first."""
    control: ControlStatistics = field(default_factory=ControlStatistics)
    """What ``prefetch``, ``demote``, ``retain`` and ``durable`` did."""
    manager: ManagerStatistics
    """The CPU pool's manager."""
    worker: WorkerStatistics
    """The worker, with every handler's snapshot."""
    poller: PollerStatistics | None = None
    """The loop's completion poller (None before the first copy)."""
