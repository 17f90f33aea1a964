"""The tier protocol: what the Offloader drives, and what every tier reports.

Data flows GPU <-> CPU pool <-> tier; no tier touches GPU memory. A tier
is two parts (DESIGN.md, "Tiers"): a pure state machine (which blocks it
holds, what to admit and evict, whether it is healthy) and I/O routes in the
worker, ``(CPU, <medium>)`` and ``(<medium>, CPU)``, that return
:class:`~aiokvo.handlers.TransferTask`\\ s like every handler. :class:`Tier`
is the object joining them that the :class:`~aiokvo.Offloader` is handed.

The Offloader's side of the conversation, all on the loop's thread:

* :meth:`Tier.bind` once, with the CPU pool (:class:`TierBinding`): the tier
  builds its handlers over the pool's pages and returns their routes;
  :meth:`Tier.open` then loads what the tier already holds (a disk tier's
  index, from a previous process);
* a load whose CPU prefix ends early asks :meth:`Tier.lookup` how many of
  the next keys the tier has, reserves CPU blocks for them, and pins them in
  the tier with :meth:`Tier.prepare_load`; after the ``(tier, CPU)`` copy,
  :meth:`Tier.complete_load` says which keys' bytes are good (checksums),
  and only those become readable in the CPU pool;
* a store offers its keys with :meth:`Tier.offer` (the admission filter);
  once the admitted keys are ready in the CPU pool they are pinned there and
  written with :meth:`Tier.prepare_store` / :meth:`Tier.complete_store`.

``prepare_*`` return None when the tier cannot take part now (its circuit
breaker is open, no room): the CPU pool simply goes on alone. A tier also
says how long one of its transfers may take (:attr:`Tier.io_timeout`): a load
waits no longer for a promotion, and the tier counts the overrun as a
failure. This module is pure (no asyncio, no torch at import).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from aiokvo.keys import OffloadKey
from aiokvo.tiers.breaker import BreakerStatistics

if TYPE_CHECKING:
    import torch

    from aiokvo.config import OffloadConfig
    from aiokvo.handlers.routes import HandlerRoute
    from aiokvo.layout import CanonicalKVCaches
    from aiokvo.manager.sink import EventSink
    from aiokvo.specs import LoadStoreSpec, TransferResult

__all__ = ["Tier", "TierBinding", "TierLoad", "TierStatistics", "TierStore"]


@dataclass(frozen=True, slots=True)
class TierBinding:
    """What a tier is bound to: the engine's layout and the CPU pool.

    ``cpu_tensors[i]`` is the pool for canonical tensor ``i`` of
    ``kv_caches`` (``(num_cpu_blocks, page_size_bytes * block_size_factor)``
    int8, rows byte-contiguous, any row stride). ``events`` is the sink the CPU
    manager publishes to; a tier publishes its own events there, with its
    own medium, so one subscription sees every tier in order. ``dtype`` is
    the engine tensors' dtype when the Offloader saw them (None for
    already-canonical caches). ``row_tail_bytes`` is the room after every
    row of every pool tensor (outside the views) that is this tier's alone:
    what its :meth:`Tier.pool_row_tail_bytes` asked for, or 0 (it did not
    ask, another tier got it, or the pool is a shared region's).
    """

    kv_caches: CanonicalKVCaches
    cpu_tensors: tuple[torch.Tensor, ...]
    config: OffloadConfig
    events: EventSink
    dtype: str | None = None
    row_tail_bytes: int = 0


@dataclass(slots=True, eq=False)
class TierLoad:
    """One reservation to read ``keys`` from a tier: ``spec`` is the copy's source.

    The object is the reservation's identity: hand it back to
    :meth:`Tier.complete_load` exactly once. ``state`` is the tier's own.
    """

    keys: list[OffloadKey]
    spec: LoadStoreSpec
    state: Any = field(default=None, repr=False)


@dataclass(slots=True, eq=False)
class TierStore:
    """One reservation to write ``keys`` to a tier: ``spec`` is the copy's destination.

    Hand it back to :meth:`Tier.complete_store` exactly once. ``evicted`` are
    the keys the tier dropped to make room. ``written`` is set by
    :meth:`Tier.complete_store` to the keys it committed (a transfer may fail
    part way, its first blocks still written); None means the tier does not
    say, and the transfer's success stands for every key.
    """

    keys: list[OffloadKey]
    spec: LoadStoreSpec
    evicted: list[OffloadKey] = field(default_factory=list)
    state: Any = field(default=None, repr=False)
    written: list[OffloadKey] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStatistics:
    """What every tier reports; a tier's own subclass adds its specifics.

    Counters count since the tier was made. Blocks are counted one by one:
    a transfer that fails part way counts its good blocks and its failures.
    """

    medium: str
    """The tier's medium (``"DISK"``, ``"MOONCAKE"``): its specs' and its events'."""
    capacity_blocks: int = 0
    """Blocks the tier can hold (0: the store places blocks, as a cluster does)."""
    used_blocks: int = 0
    """Blocks held now (ready or being written), as far as the tier knows."""
    capacity_bytes: int = 0
    """Bytes the tier may take (0: unknown, the store's own business)."""
    used_bytes: int = 0
    """Bytes held now (0 where ``capacity_bytes`` is)."""
    connected: bool = True
    """The store is reachable (stores that connect: False until they have)."""
    connects: int = 0
    """Times the store connected (stores that connect; a reconnection counts again)."""
    connect_failures: int = 0
    """Connection attempts that failed or passed their deadline."""
    lookups: int = 0
    """Lookup calls."""
    lookup_hits: int = 0
    """Keys lookups found."""
    lookup_misses: int = 0
    """Lookup calls that stopped at a key the tier lacks."""
    lookups_bypassed: int = 0
    """Lookup calls answered 0 without asking: the store disconnected or the breaker open."""
    remote_lookups: int = 0
    """Calls asking a remote store which keys exist (lookups in one loop turn share one)."""
    lookup_failures: int = 0
    """Remote lookup calls that failed or passed their deadline."""
    lookup_timeouts: int = 0
    """Remote lookup calls that passed their deadline."""
    reads: int = 0
    """Read transfers (promotions into the CPU pool) that ended."""
    blocks_read: int = 0
    """Blocks read back good."""
    read_failures: int = 0
    """Blocks a read did not bring back (each a miss)."""
    bytes_read: int = 0
    """Payload bytes of the good blocks read."""
    read_seconds: float = 0.0
    """Time the read transfers took, summed."""
    offers: int = 0
    """Keys offered for writing (the admission filter counts them)."""
    admitted: int = 0
    """Offered keys let through to be written."""
    writes: int = 0
    """Write transfers that ended."""
    blocks_written: int = 0
    """Blocks written and made readable."""
    write_failures: int = 0
    """Blocks a write did not commit."""
    writes_refused: int = 0
    """Keys not written: no room, the breaker open or the store disconnected."""
    bytes_written: int = 0
    """Payload bytes of the blocks written."""
    write_seconds: float = 0.0
    """Time the write transfers took, summed."""
    checksum_failures: int = 0
    """Blocks read back wrong (``CORRUPT``: each a miss, dropped from the tier)."""
    stale_reads: int = 0
    """Blocks the store had moved on from (``STALE``: replaced by another writer)."""
    evictions: int = 0
    """Blocks the tier evicted to make room (a cluster's own are not seen)."""
    removals: int = 0
    """Blocks dropped for bad bytes (evictions not included)."""
    timeouts: int = 0
    """Transfers past their deadline."""
    store_failures: int = 0
    """Transfers the store failed (I/O errors, failed calls): the breaker's failures."""
    abandoned: int = 0
    """Transfers still stuck in the store when the tier closed, left to finish alone."""
    failure_causes: dict[str, int] = field(default_factory=dict)
    """Failed blocks by the store's own cause (``"not_found"``, ``"bad_trailer"``, ...)."""
    breaker: BreakerStatistics = field(default_factory=BreakerStatistics)
    """The circuit breaker's snapshot."""

    GAUGES: ClassVar[frozenset[str]] = frozenset({
        "capacity_blocks", "used_blocks", "capacity_bytes", "used_bytes",
    })  # fmt: skip
    """Numeric fields that say how things are now (the others count since start): an
    exporter reads them as gauges. A subclass adds its own."""


class Tier(ABC):
    """A storage tier below the CPU pool, driven by the Offloader; see the module.

    Everything but :meth:`open`, :meth:`lookup` and :meth:`aclose` is
    synchronous, and all of it runs on the loop's thread.
    """

    medium: str
    """The tier's medium: its specs' ``medium()`` and its events' ``medium``."""

    io_timeout: float
    """Seconds one transfer of this tier may take, queueing included."""

    def pool_row_tail_bytes(self, kv_caches: CanonicalKVCaches, config: OffloadConfig) -> int:
        """Room the tier would like after every CPU-pool row, for bytes of its own.

        Asked before the pool exists; the first tier that asks for room gets
        it (in :attr:`TierBinding.row_tail_bytes`), because two tiers writing
        one row's room would overwrite each other. Default: none.
        """
        return 0

    @abstractmethod
    def bind(self, binding: TierBinding) -> Sequence[HandlerRoute]:
        """Build the tier's handlers over the CPU pool; their routes, for the worker.

        Called once, before anything else. The worker owns (and closes) them.
        """

    async def open(self) -> None:
        """Load what the tier already holds; called once after :meth:`bind`."""
        return

    async def first_connection(self) -> bool:
        """After :meth:`open`: wait until a tier that connects has tried once (bounded
        by its own deadline); whether it is connected. Others: True at once."""
        return True

    @abstractmethod
    def lookup_nowait(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` the tier holds ready now, from what it knows."""

    async def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` the tier holds ready (a remote tier may ask)."""
        return self.lookup_nowait(keys)

    def committed(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The ``keys`` (any order) the tier knows it holds committed now: what
        ``durable`` and ``demote`` wait for. Counts nothing, asks no remote store."""
        return [k for k in dict.fromkeys(keys) if self.lookup_nowait([k])]

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> TierLoad | None:
        """Pin ``keys`` (a prefix :meth:`lookup` reported) for reading, or None."""

    @abstractmethod
    def complete_load(self, load: TierLoad, result: TransferResult) -> list[OffloadKey]:
        """The copy of ``load`` ended: release it; the keys whose bytes are good.

        Keys that failed (checksum, I/O) are misses the tier counts and, where
        the data is bad, removes.
        """

    @abstractmethod
    def offer(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Count one offer of each key; those to write now (admitted and not held)."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> TierStore | None:
        """Reserve room for ``keys`` (admitted, ready in the CPU pool), or None."""

    @abstractmethod
    def complete_store(self, store: TierStore, result: TransferResult) -> None:
        """The copy of ``store`` ended: the keys it wrote are readable, the rest released.

        Sets ``store.written`` to the keys written, so that the Offloader
        counts them block by block.
        """

    @abstractmethod
    def statistics(self) -> TierStatistics:
        """A frozen snapshot of the tier."""

    async def aclose(self) -> None:
        """Release what the tier owns (its handlers belong to the worker)."""
        return
