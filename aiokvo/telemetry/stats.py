"""Per-tier totals and rates from aiokvo's statistics snapshots (pure, no optional deps).

Every exporter needs the same arithmetic: which tier a counter belongs to,
which way a transfer went, a hit rate, bytes per second over an interval.
This module does it once, on frozen snapshots, for the Prometheus collector
(:mod:`aiokvo.telemetry.prometheus`), the live view
(``python -m aiokvo.telemetry watch``) and ``examples/telemetry.py``.

**Tiers are read generically, by field name**, so that a tier appears in
every exporter without new code. :func:`tier_totals` reads any statistics
object (a dataclass snapshot, or anything with attributes) for the fields of
:class:`TierTotals`, under the names listed in :data:`TIER_FIELDS`; a nested
``manager`` (a :class:`~aiokvo.manager.stats.ManagerStatistics`, as a tier
that reuses a manager over its own slots would report) is read first and
overridden by the snapshot's own fields. Absent fields stay None and are
left out of the exports. :func:`totals_from_statistics` finds the tiers of an
Offloader's snapshot: the CPU pool (its manager and the Offloader's own
counters) and, when the snapshot has one, a ``tiers`` attribute: a mapping
``medium -> snapshot`` or a sequence of snapshots with a ``medium`` field.

**Transfers are keyed by direction and medium**, read off each handler's
:class:`~aiokvo.handlers.stats.HandlerStatistics` (its ``transfer_type``):
towards the GPU is a ``load``, away from it a ``store``, and the medium is
the tier on the far side from the GPU (:func:`transfer_direction`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal

from aiokvo.handlers.stats import HandlerStatistics, WorkerStatistics
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.offloader.results import OffloaderStatistics
from aiokvo.specs import TransferType

__all__ = [
    "TIER_FIELDS",
    "Direction",
    "TierRates",
    "TierTotals",
    "Totals",
    "TransferTotals",
    "format_lines",
    "rates",
    "tier_totals",
    "transfer_totals",
    "totals_from_statistics",
    "transfer_direction",
]

Direction = Literal["load", "store"]

_TIER_ORDER = {"GPU": 0, "CPU": 1}  # every other medium is further from the GPU


def transfer_direction(transfer_type: TransferType) -> tuple[Direction, str]:
    """``("store", "CPU")`` for GPU->CPU, ``("load", "DISK")`` for DISK->CPU, ...

    A transfer towards the GPU is a load, one away from it a store; the medium
    is the side further from the GPU (the tier being read or written).
    """
    src, dst = transfer_type
    if _TIER_ORDER.get(src, 2) <= _TIER_ORDER.get(dst, 2) and src != dst:
        return "store", dst
    return "load", src


@dataclass(frozen=True, slots=True, kw_only=True)
class TierTotals:
    """One tier's counters and occupancy at one instant; None where it does not say.

    ``lookups`` lookup calls; ``hit_blocks`` / ``miss_blocks`` blocks found /
    asked for past the hit prefix; ``stored_blocks``, ``loaded_blocks`` and
    ``evicted_blocks`` since start; ``store_failed_blocks`` /
    ``load_failed_blocks`` blocks whose copy failed; ``stores_refused`` stores
    that found no room; ``checksum_failures`` blocks read back wrong (dropped,
    served as misses); ``timeouts`` transfers past their deadline;
    ``breaker_state`` the tier's circuit breaker (``"closed"``, ``"open"``,
    ``"half_open"``) and ``breaker_trips`` times it opened. Occupancy: ``num_blocks`` capacity,
    ``used_blocks``, ``pinned_blocks``, ``writing_blocks``, and the same in
    bytes where known (``capacity_bytes``, ``used_bytes``).
    """

    medium: str
    lookups: int | None = None
    hit_blocks: int | None = None
    miss_blocks: int | None = None
    stored_blocks: int | None = None
    loaded_blocks: int | None = None
    evicted_blocks: int | None = None
    store_failed_blocks: int | None = None
    load_failed_blocks: int | None = None
    stores_refused: int | None = None
    checksum_failures: int | None = None
    timeouts: int | None = None
    breaker_state: str | None = None
    breaker_trips: int | None = None
    num_blocks: int | None = None
    used_blocks: int | None = None
    pinned_blocks: int | None = None
    writing_blocks: int | None = None
    capacity_bytes: int | None = None
    used_bytes: int | None = None

    @property
    def hit_rate(self) -> float | None:
        """Hit blocks over blocks asked for, since start (None before any lookup)."""
        return _ratio(self.hit_blocks, self.miss_blocks)

    @property
    def usage(self) -> float | None:
        """Used over capacity, in blocks, else in bytes (None when unknown)."""
        if self.used_blocks is not None and self.num_blocks:
            return self.used_blocks / self.num_blocks
        if self.used_bytes is not None and self.capacity_bytes:
            return self.used_bytes / self.capacity_bytes
        return None


TIER_FIELDS: Mapping[str, tuple[str, ...]] = {
    "lookups": ("lookups",),
    "hit_blocks": ("hit_blocks", "lookup_hits", "hits"),
    "miss_blocks": ("miss_blocks", "misses"),
    "stored_blocks": ("blocks_stored", "stored_blocks", "blocks_written"),
    "loaded_blocks": ("blocks_loaded", "loaded_blocks", "blocks_read"),
    "evicted_blocks": ("blocks_evicted", "evicted_blocks", "evictions"),
    "store_failed_blocks": ("blocks_store_failed", "store_failed_blocks", "write_failures"),
    "load_failed_blocks": ("blocks_load_failed", "load_failed_blocks", "read_failures"),
    "stores_refused": ("stores_refused",),
    "checksum_failures": ("checksum_failures",),
    "timeouts": ("timeouts",),
    "breaker_state": ("breaker_state", "breaker"),
    "breaker_trips": ("breaker_trips",),
    "num_blocks": ("num_blocks", "capacity_blocks"),
    "used_blocks": ("used_blocks",),
    "pinned_blocks": ("pinned_blocks",),
    "writing_blocks": ("writing_blocks",),
    "capacity_bytes": ("capacity_bytes",),
    "used_bytes": ("used_bytes",),
}
"""The attribute names :func:`tier_totals` reads for each :class:`TierTotals` field,
first match wins. A tier's statistics that use one of them is exported as is."""


def tier_totals(medium: str, snapshot: object) -> TierTotals:
    """A :class:`TierTotals` read from any statistics object, by field name.

    A nested ``manager`` snapshot is read first, then the object's own
    fields (:data:`TIER_FIELDS`) override it. Counters must be ints, the
    breaker state a string, an enum (its value), a bool (``breaker_open``
    style: True is ``"open"``) or a breaker snapshot with ``state`` (and
    ``trips``); anything else is ignored.
    """
    values: dict[str, Any] = {}
    nested = getattr(snapshot, "manager", None)
    for source in (nested, snapshot):
        if source is None:
            continue
        for name, aliases in TIER_FIELDS.items():
            for alias in aliases:
                value = getattr(source, alias, None)
                if value is None:
                    continue
                value = _breaker(value) if name == "breaker_state" else _count(value)
                if value is not None:
                    values[name] = value
                    break
    if "breaker_state" not in values:
        is_open = getattr(snapshot, "breaker_open", None)
        if isinstance(is_open, bool):
            values["breaker_state"] = "open" if is_open else "closed"
    breaker = getattr(snapshot, "breaker", None)
    if "breaker_trips" not in values and breaker is not None:
        trips = _count(getattr(breaker, "trips", None))
        if trips is not None:
            values["breaker_trips"] = trips
    return TierTotals(medium=str(getattr(snapshot, "medium", medium) or medium), **values)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferTotals:
    """Transfers one way to or from one tier: ``transfers`` finished, ``failures``
    of them failed, ``bytes`` and ``seconds`` (copy time) of the successful ones,
    ``in_flight`` now."""

    direction: Direction
    medium: str
    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    seconds: float = 0.0
    in_flight: int = 0

    def __add__(self, other: TransferTotals) -> TransferTotals:
        return TransferTotals(
            direction=self.direction,
            medium=self.medium,
            transfers=self.transfers + other.transfers,
            failures=self.failures + other.failures,
            bytes=self.bytes + other.bytes,
            seconds=self.seconds + other.seconds,
            in_flight=self.in_flight + other.in_flight,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Totals:
    """Everything an exporter shows, at ``at`` (``time.monotonic()``).

    ``tiers`` by medium, ``transfers`` by ``(direction, medium)``.
    """

    at: float
    tiers: Mapping[str, TierTotals] = field(default_factory=dict)
    transfers: Mapping[tuple[Direction, str], TransferTotals] = field(default_factory=dict)

    def transfer(self, direction: Direction, medium: str) -> TransferTotals:
        """The totals one way for one medium (zeros when there were none)."""
        found = self.transfers.get((direction, medium))
        return found if found is not None else TransferTotals(direction=direction, medium=medium)

    def media(self) -> list[str]:
        """Every medium with a tier or a transfer, CPU first, then by name."""
        names = set(self.tiers) | {medium for _, medium in self.transfers}
        return sorted(names, key=lambda m: (_TIER_ORDER.get(m, 2), m))


def transfer_totals(
    handlers: Iterable[HandlerStatistics],
) -> dict[tuple[Direction, str], TransferTotals]:
    """Handler snapshots summed by ``(direction, medium)`` (handlers without a
    single direction are left out)."""
    out: dict[tuple[Direction, str], TransferTotals] = {}
    for h in handlers:
        if h.transfer_type is None:
            continue
        direction, medium = transfer_direction(h.transfer_type)
        one = TransferTotals(
            direction=direction, medium=medium, transfers=h.completed, failures=h.failed,
            bytes=h.bytes, seconds=h.seconds, in_flight=h.in_flight,
        )
        key = (direction, medium)
        out[key] = out[key] + one if key in out else one
    return out


def totals_from_statistics(
    stats: OffloaderStatistics | ManagerStatistics | WorkerStatistics,
    *,
    medium: str = "CPU",
    block_bytes: int | None = None,
    tiers: Mapping[str, object] | None = None,
    at: float | None = None,
) -> Totals:
    """:class:`Totals` from an Offloader's (or a manager's, or a worker's) snapshot.

    ``medium`` names the pool of ``stats``'s manager, ``block_bytes`` is one
    of its blocks in bytes (``config.kv_bytes_per_offloaded_block``; without
    it, occupancy is in blocks only). ``tiers`` adds other tiers' snapshots by
    medium, next to any the snapshot itself carries in ``tiers``.
    """
    found: dict[str, TierTotals] = {}
    transfers: dict[tuple[Direction, str], TransferTotals] = {}
    if isinstance(stats, OffloaderStatistics):
        found[medium] = _pool_tier(medium, stats.manager, stats, block_bytes)
        transfers = transfer_totals(stats.worker.handlers)
    elif isinstance(stats, ManagerStatistics):
        found[medium] = _pool_tier(medium, stats, None, block_bytes)
    elif isinstance(stats, WorkerStatistics):
        transfers = transfer_totals(stats.handlers)
    else:
        raise TypeError(f"expected an Offloader, manager or worker snapshot, got {stats!r}")
    for name, snapshot in _carried_tiers(stats):
        found.setdefault(name, tier_totals(name, snapshot))
    for name, snapshot in (tiers or {}).items():
        found[name] = tier_totals(name, snapshot)
    if isinstance(stats, OffloaderStatistics):
        _split_hits(stats, medium, found)
    return Totals(at=time.monotonic() if at is None else at, tiers=found, transfers=transfers)


def _pool_tier(
    medium: str,
    manager: ManagerStatistics,
    offloader: OffloaderStatistics | None,
    block_bytes: int | None,
) -> TierTotals:
    """The manager's pool, with the Offloader's block-level hits and loads when there is one."""
    if offloader is not None:
        hits, misses = offloader.hit_blocks, offloader.miss_blocks
        loaded, load_failed = offloader.blocks_loaded, offloader.blocks_load_failed
    else:  # a bare manager knows hit keys, not the keys asked for past them
        hits, misses, loaded, load_failed = manager.lookup_hits, None, None, None
    return TierTotals(
        medium=medium,
        lookups=manager.lookups,
        hit_blocks=hits,
        miss_blocks=misses,
        stored_blocks=manager.blocks_stored,
        loaded_blocks=loaded,
        evicted_blocks=manager.blocks_evicted,
        store_failed_blocks=manager.blocks_store_failed,
        load_failed_blocks=load_failed,
        stores_refused=manager.stores_refused,
        num_blocks=manager.num_blocks,
        used_blocks=manager.used_blocks,
        pinned_blocks=manager.pinned_blocks,
        writing_blocks=manager.writing_blocks,
        capacity_bytes=None if block_bytes is None else manager.num_blocks * block_bytes,
        used_bytes=None if block_bytes is None else manager.used_blocks * block_bytes,
    )


def _split_hits(stats: OffloaderStatistics, medium: str, found: dict[str, TierTotals]) -> None:
    """Per-tier hits and misses from ``hits_by_medium``, when the snapshot has it.

    A load asks the pool, then each tier below in turn (``tiers`` is top
    first) for what the ones above lacked: tier ``k`` was asked for every
    block the tiers above did not hit, and missed what it did not hit itself.
    """
    by_medium = getattr(stats, "hits_by_medium", None)
    if not isinstance(by_medium, Mapping) or not by_medium:
        return
    order = [medium, *(name for name, _ in _carried_tiers(stats) if name != medium)]
    asked = stats.hit_blocks + stats.miss_blocks
    for name in order:
        # A tier the Offloader does not list (one passed to the exporter by hand)
        # keeps its own counts; the Offloader lists each of its tiers, at 0 too.
        hits = by_medium.get(name)
        if not isinstance(hits, int) or name not in found:
            continue
        found[name] = replace(found[name], hit_blocks=hits, miss_blocks=max(asked - hits, 0))
        asked -= hits


def _carried_tiers(stats: object) -> list[tuple[str, object]]:
    """The ``tiers`` a snapshot carries: a mapping by medium, or snapshots with ``medium``."""
    carried = getattr(stats, "tiers", None)
    if carried is None:
        return []
    if isinstance(carried, Mapping):
        return [(str(name), snap) for name, snap in carried.items()]
    return [(str(getattr(snap, "medium", "?")), snap) for snap in carried]


# -- rates over an interval ---------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TierRates:
    """One tier between two :class:`Totals`: ``hit_rate`` over the interval (None
    without lookups in it), ``load_bps`` / ``store_bps`` bytes per second each
    way, ``evictions_per_s`` and ``stores_per_s`` (blocks), and the later
    totals themselves (``totals``: cumulative hit rate, usage, ...)."""

    medium: str
    seconds: float
    hit_rate: float | None
    load_bps: float
    store_bps: float
    evictions_per_s: float | None
    stores_per_s: float | None
    totals: TierTotals


def rates(earlier: Totals | None, later: Totals) -> dict[str, TierRates]:
    """Per-medium rates between two totals (since zero when ``earlier`` is None).

    Counters that went down (the source restarted) count from zero again.
    """
    seconds = later.at - earlier.at if earlier is not None else 0.0
    out: dict[str, TierRates] = {}
    for medium in later.media():
        now = later.tiers.get(medium, TierTotals(medium=medium))
        before = None if earlier is None else earlier.tiers.get(medium)
        moved = {
            direction: _delta(
                later.transfer(direction, medium).bytes,
                None if earlier is None else earlier.transfer(direction, medium).bytes,
            ) or 0
            for direction in ("load", "store")
        }
        out[medium] = TierRates(
            medium=medium,
            seconds=seconds,
            hit_rate=_ratio(_field_delta(now, before, "hit_blocks"),
                            _field_delta(now, before, "miss_blocks")),
            load_bps=moved["load"] / seconds if seconds > 0 else 0.0,
            store_bps=moved["store"] / seconds if seconds > 0 else 0.0,
            evictions_per_s=_per_s(_field_delta(now, before, "evicted_blocks"), seconds),
            stores_per_s=_per_s(_field_delta(now, before, "stored_blocks"), seconds),
            totals=now,
        )
    return out


def format_lines(tier_rates: Mapping[str, TierRates]) -> list[str]:
    """One plain line per tier (the live view's non-terminal output, the example's)."""
    lines = []
    for medium, r in tier_rates.items():
        t = r.totals
        parts = [f"{medium:<8}"]
        parts.append(f"hit {_pct(r.hit_rate):>6} (total {_pct(t.hit_rate)})")
        parts.append(f"load {r.load_bps / 1e9:6.2f} GB/s  store {r.store_bps / 1e9:6.2f} GB/s")
        if t.used_blocks is not None and t.num_blocks is not None:
            parts.append(f"pool {t.used_blocks}/{t.num_blocks} blocks ({_pct(t.usage)})")
        elif t.used_bytes is not None:
            parts.append(f"pool {t.used_bytes / 2**30:.2f} GiB ({_pct(t.usage)})")
        elif t.used_blocks is not None:
            parts.append(f"pool {t.used_blocks} blocks")
        parts.append(f"stored {_num(t.stored_blocks)}  evicted {_num(t.evicted_blocks)}")
        if r.evictions_per_s is not None:
            parts.append(f"({r.evictions_per_s:.0f}/s)")
        if t.checksum_failures:
            parts.append(f"checksum failures {t.checksum_failures}")
        if t.timeouts:
            parts.append(f"timeouts {t.timeouts}")
        if t.breaker_state is not None and t.breaker_state != "closed":
            parts.append(f"breaker {t.breaker_state}")
        lines.append("  ".join(parts))
    return lines


# -- helpers ------------------------------------------------------------------------


def _ratio(hits: int | None, misses: int | None) -> float | None:
    if hits is None or misses is None or hits + misses <= 0:
        return None
    return hits / (hits + misses)


def _field_delta(now: TierTotals, before: TierTotals | None, name: str) -> int | None:
    return _delta(getattr(now, name), None if before is None else getattr(before, name))


def _per_s(value: int | None, seconds: float) -> float | None:
    return None if value is None or seconds <= 0 else value / seconds


def _delta(now: int | float | None, before: int | float | None) -> int | None:
    if now is None:
        return None
    if before is None or now < before:
        return int(now)
    return int(now - before)


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _breaker(value: object) -> str | None:
    if isinstance(value, Enum):
        value = value.value if isinstance(value.value, str) else value.name.lower()
    if isinstance(value, bool):
        return "open" if value else "closed"
    if not isinstance(value, str) and hasattr(value, "state"):  # a breaker's snapshot
        return _breaker(value.state)
    return value if isinstance(value, str) else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)

