"""Per-tier totals and rates from aiokvo's statistics snapshots (pure, no optional deps).

Every exporter needs the same arithmetic: which tier a counter belongs to,
which way a transfer went, a hit rate, bytes per second over an interval.
This module does it once, on frozen snapshots, for the Prometheus collector
(:mod:`aiokvo.telemetry.prometheus`), the live view (``aiokvo watch``) and
``examples/telemetry.py``.

**Typed, counted once.** Each part counts its own work once and this module
reads its typed snapshot: the CPU pool from its
:class:`~aiokvo.manager.stats.ManagerStatistics` and the Offloader's own
counters (:class:`~aiokvo.offloader.results.OffloaderStatistics`), each tier
below from its :class:`~aiokvo.tiers.TierStatistics` (:func:`tier_totals`).
:class:`TierTotals` is what every tier, the pool included, has in common.

**Transfers are keyed by direction and medium**, read off each handler's
:class:`~aiokvo.handlers.stats.HandlerStatistics` (its ``transfer_type``):
towards the GPU is a ``load``, away from it a ``store``, and the medium is
the tier on the far side from the GPU (:func:`transfer_direction`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from aiokvo.handlers.stats import HandlerStatistics, WorkerStatistics
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.offloader.results import OffloaderStatistics
from aiokvo.specs import TransferType
from aiokvo.tiers.base import TierStatistics

__all__ = [
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


def tier_totals(stats: TierStatistics) -> TierTotals:
    """What a tier below the CPU pool has in common with every tier, from its snapshot."""
    return TierTotals(
        medium=stats.medium,
        lookups=stats.lookups,
        hit_blocks=stats.lookup_hits,
        stored_blocks=stats.blocks_written,
        loaded_blocks=stats.blocks_read,
        evicted_blocks=stats.evictions,
        store_failed_blocks=stats.write_failures,
        load_failed_blocks=stats.read_failures,
        checksum_failures=stats.checksum_failures,
        timeouts=stats.timeouts,
        breaker_state=stats.breaker.state,
        breaker_trips=stats.breaker.trips,
        num_blocks=stats.capacity_blocks or None,
        used_blocks=stats.used_blocks,
        capacity_bytes=stats.capacity_bytes or None,
        used_bytes=stats.used_bytes if stats.capacity_bytes else None,
    )


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
    control: Mapping[str, float] = field(default_factory=dict)
    """The cache-control counters by field (``prefetches``, ...; retention's as
    ``retention_<field>``), from ``aiokvo_control_*`` / ``aiokvo_retention_*``."""

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
    tiers: Mapping[str, TierStatistics | ManagerStatistics] | None = None,
    at: float | None = None,
) -> Totals:
    """:class:`Totals` from an Offloader's (or a manager's, or a worker's) snapshot.

    ``medium`` names the pool of ``stats``'s manager, ``block_bytes`` is one
    of its blocks in bytes (``config.kv_bytes_per_offloaded_block``; without
    it, occupancy is in blocks only). An Offloader's snapshot carries its
    tiers; ``tiers`` adds others by medium (a tier's snapshot, or another
    pool's manager's).
    """
    found: dict[str, TierTotals] = {}
    transfers: dict[tuple[Direction, str], TransferTotals] = {}
    if isinstance(stats, OffloaderStatistics):
        found[medium] = _pool_tier(medium, stats.manager, stats, block_bytes)
        transfers = transfer_totals(stats.worker.handlers)
        for tier in stats.tiers:
            found.setdefault(tier.medium, tier_totals(tier))
    elif isinstance(stats, ManagerStatistics):
        found[medium] = _pool_tier(medium, stats, None, block_bytes)
    elif isinstance(stats, WorkerStatistics):
        transfers = transfer_totals(stats.handlers)
    else:
        raise TypeError(f"expected an Offloader, manager or worker snapshot, got {stats!r}")
    for name, snapshot in (tiers or {}).items():
        if isinstance(snapshot, TierStatistics):
            found[name] = replace(tier_totals(snapshot), medium=name)
        elif isinstance(snapshot, ManagerStatistics):
            found[name] = _pool_tier(name, snapshot, None, None)
        else:
            raise TypeError(f"tiers[{name!r}] must be a tier's or a manager's snapshot, "
                            f"got {snapshot!r}")  # fmt: skip
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
    """Per-tier hits and misses from ``hits_by_medium``.

    A load asks the pool, then each tier below in turn (``tiers`` is top
    first) for what the ones above lacked: tier ``k`` was asked for every
    block the tiers above did not hit, and missed what it did not hit itself.
    """
    by_medium = stats.hits_by_medium
    if not by_medium:
        return
    order = [medium, *(t.medium for t in stats.tiers if t.medium != medium)]
    asked = stats.hit_blocks + stats.miss_blocks
    for name in order:
        hits = by_medium.get(name)
        if hits is None or name not in found:
            continue
        found[name] = replace(found[name], hit_blocks=hits, miss_blocks=max(asked - hits, 0))
        asked -= hits


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


def format_control(control: Mapping[str, float]) -> str | None:
    """One plain line of the cache-control counters (None when nothing was asked)."""
    c = {k: round(v) for k, v in control.items()}
    asked = c.get("prefetches", 0) + c.get("demotions", 0) + c.get("durable_waits", 0)
    if not asked and not c.get("retention_made", 0):
        return None
    parts = [
        f"hints    prefetch {c.get('prefetches', 0)} (late {c.get('prefetches_late', 0)})",
        f"blocks {c.get('prefetched_blocks', 0)} used {c.get('prefetch_used_blocks', 0)} "
        f"wasted {c.get('prefetch_wasted_blocks', 0)}",
        f"demoted {c.get('demoted_blocks', 0)}",
        f"durable {c.get('durable_waits', 0)} (timeouts {c.get('durable_timeouts', 0)})",
    ]
    if "retention_budget_blocks" in c:
        parts.append(
            f"retained {c.get('retention_retained_blocks', 0)}/{c['retention_budget_blocks']}"
        )
    return "  ".join(parts)


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


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)

