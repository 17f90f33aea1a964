"""What the Offloader reports: one :class:`StoreResult` per store, and its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokvo.handlers.stats import WorkerStatistics
from aiokvo.keys import OffloadKey
from aiokvo.manager.stats import ManagerStatistics
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
    """An Offloader's counters since it was made, its work in flight, and its parts.

    Counted by the Offloader itself (keys are counted once per call that
    named them):

    * loads: ``loads`` ``load_prefix`` calls; ``leases`` ``pin_prefix`` calls
      that pinned something (``active_leases`` still hold pins);
      ``hit_blocks`` keys found ready and pinned by either, ``miss_blocks``
      keys ``load_prefix`` asked for past the ready prefix; ``blocks_loaded``
      and ``blocks_load_failed`` keys whose copy succeeded or failed;
      ``store_waits`` times a load waited for a store of its prefix in flight,
      ``polled_waits`` times it had to poll for a store the Offloader did not
      make (one started by hand on the manager);
    * stores: ``stores`` ``store`` calls, ``stores_refused`` of them found no
      room; ``blocks_stored``, ``blocks_skipped``, ``blocks_evicted``,
      ``blocks_store_refused`` and ``blocks_store_failed`` add up the calls'
      :class:`StoreResult` fields;
    * transfers each way: ``load_transfers`` / ``store_transfers`` copies
      finished, ``load_transfer_failures`` / ``store_transfer_failures`` of
      them failed, ``load_bytes`` / ``store_bytes`` and ``load_seconds`` /
      ``store_seconds`` of the successful ones (bytes and copy time, from
      their :class:`~aiokvo.TransferResult`);
    * now: ``loads_in_flight``, ``stores_in_flight`` (copies not finished),
      ``writing_keys`` (keys those stores are writing) and ``waiters``
      (coroutines waiting in ``ready`` or for a store in ``load_prefix``);
      ``cancelled_waits`` counts calls cancelled while their copy went on;
    * ``closed`` once ``aclose()`` began;
    * tiers: ``hits_by_medium`` splits ``hit_blocks`` by where the block was
      found (``"CPU"``, and each tier's medium for blocks it promoted);
      ``promotions`` tier-to-CPU transfers, ``promoted_blocks`` and
      ``promotion_failures`` blocks that came back good or not,
      ``promotion_timeouts`` promotions a load stopped waiting for (past
      their tier's ``io_timeout``), ``promotions_no_room`` promotions not
      started because the CPU pool had no room left for them once the tier
      had answered (the load's prefix ends there); ``tier_writes``
      write-through transfers, ``tier_write_blocks`` /
      ``tier_write_failures`` blocks written or not (block by block, as the
      tier counts them: a transfer failing part way counts both),
      ``tier_writes_skipped`` blocks not written because a tier's writes in
      flight already pinned its share of the pool; ``tiers`` each tier's
      own snapshot, top first.

    ``manager``, ``worker`` (with every handler) and ``poller`` (None before
    the first copy) are the parts' own snapshots, taken at the same moment.
    """

    loads: int = 0
    leases: int = 0
    active_leases: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    blocks_loaded: int = 0
    blocks_load_failed: int = 0
    store_waits: int = 0
    polled_waits: int = 0
    stores: int = 0
    stores_refused: int = 0
    blocks_stored: int = 0
    blocks_skipped: int = 0
    blocks_evicted: int = 0
    blocks_store_failed: int = 0
    blocks_store_refused: int = 0
    load_transfers: int = 0
    load_transfer_failures: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_transfers: int = 0
    store_transfer_failures: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    loads_in_flight: int = 0
    stores_in_flight: int = 0
    writing_keys: int = 0
    waiters: int = 0
    cancelled_waits: int = 0
    closed: bool = False
    hits_by_medium: dict[str, int] = field(default_factory=dict)
    promotions: int = 0
    promoted_blocks: int = 0
    promotion_failures: int = 0
    promotion_timeouts: int = 0
    promotions_no_room: int = 0
    tier_writes: int = 0
    tier_write_blocks: int = 0
    tier_write_failures: int = 0
    tier_writes_skipped: int = 0
    tiers: tuple[TierStatistics, ...] = ()
    manager: ManagerStatistics
    worker: WorkerStatistics
    poller: PollerStatistics | None = None
