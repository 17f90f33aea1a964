"""Per-tier totals and rates (aiokvo.telemetry.stats): pure arithmetic on snapshots."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest

from aiokvo.handlers.stats import HandlerStatistics, WorkerStatistics
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.telemetry.stats import (
    TierTotals,
    Totals,
    TransferTotals,
    format_lines,
    rates,
    tier_totals,
    totals_from_statistics,
    transfer_direction,
)


@pytest.mark.parametrize(
    ("route", "expected"),
    [
        (("GPU", "CPU"), ("store", "CPU")),
        (("CPU", "GPU"), ("load", "CPU")),
        (("CPU", "DISK"), ("store", "DISK")),
        (("DISK", "CPU"), ("load", "DISK")),
        (("DISK", "GPU"), ("load", "DISK")),
        (("DISK", "MOONCAKE"), ("store", "MOONCAKE")),
    ],
)
def test_a_transfer_is_named_by_the_tier_away_from_the_gpu(
    route: tuple[str, str], expected: tuple[str, str]
) -> None:
    assert transfer_direction(route) == expected


class Breaker(enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Snapshot:
    medium: str
    manager: ManagerStatistics | None = None
    hits: int | None = None
    evictions: int | None = None
    breaker: object = None
    breaker_open: object = None
    checksum_failures: object = None


def test_tier_fields_are_read_by_name_with_the_manager_underneath() -> None:
    manager = ManagerStatistics(num_blocks=10, used_blocks=5, lookup_hits=7, blocks_evicted=1)
    t = tier_totals("X", Snapshot("DISK", manager, hits=9, evictions=4, breaker=Breaker.HALF_OPEN))
    assert t.medium == "DISK"  # the snapshot's own medium wins over the key
    assert (t.hit_blocks, t.evicted_blocks) == (9, 4)  # its own fields beat the manager's
    assert (t.num_blocks, t.used_blocks, t.usage) == (10, 5, 0.5)
    assert t.breaker_state == "half_open"
    assert t.checksum_failures is None and t.hit_rate is None  # no misses reported


def test_a_tier_field_of_the_wrong_type_is_ignored_not_exported() -> None:
    t = tier_totals("DISK", Snapshot("DISK", checksum_failures=True, breaker_open=True))
    assert t.checksum_failures is None  # a bool is not a count
    assert t.breaker_state == "open"
    assert tier_totals("DISK", Snapshot("DISK", breaker_open=False)).breaker_state == "closed"
    assert tier_totals("DISK", Snapshot("DISK", checksum_failures=1.5)).checksum_failures is None


def test_totals_of_a_manager_or_a_worker_snapshot() -> None:
    manager = ManagerStatistics(num_blocks=4, used_blocks=4, lookups=3, lookup_hits=2)
    t = totals_from_statistics(manager, block_bytes=100, at=1.0).tiers["CPU"]
    assert (t.lookups, t.hit_blocks, t.miss_blocks) == (3, 2, None)
    assert (t.capacity_bytes, t.used_bytes) == (400, 400)
    handlers = (
        HandlerStatistics(transfer_type=("GPU", "CPU"), completed=2, bytes=10, seconds=0.5),
        HandlerStatistics(transfer_type=("GPU", "CPU"), completed=1, bytes=5, in_flight=1),
        HandlerStatistics(transfer_type=None, completed=9),
    )
    totals = totals_from_statistics(WorkerStatistics(handlers=handlers), at=2.0)
    assert totals.tiers == {}
    assert totals.transfer("store", "CPU") == TransferTotals(
        direction="store", medium="CPU", transfers=3, bytes=15, seconds=0.5, in_flight=1
    )
    assert totals.transfer("load", "CPU").transfers == 0
    with pytest.raises(TypeError, match="snapshot"):
        totals_from_statistics(object())  # type: ignore[arg-type]


def cpu(at: float, *, hits: int, misses: int, evicted: int, loaded: int) -> Totals:
    return Totals(
        at=at,
        tiers={"CPU": TierTotals(medium="CPU", hit_blocks=hits, miss_blocks=misses,
                                 evicted_blocks=evicted, used_blocks=6, num_blocks=8)},
        transfers={("load", "CPU"): TransferTotals(direction="load", medium="CPU",
                                                   bytes=loaded)},
    )


def test_rates_over_an_interval() -> None:
    before = cpu(10.0, hits=10, misses=10, evicted=5, loaded=1_000)
    after = cpu(12.0, hits=40, misses=20, evicted=25, loaded=4_000_000_000)
    r = rates(before, after)["CPU"]
    assert r.seconds == 2.0
    assert r.hit_rate == 30 / 40  # the interval's, not the total's (40 / 60)
    assert r.totals.hit_rate == 40 / 60
    assert r.load_bps == pytest.approx((4_000_000_000 - 1_000) / 2)
    assert r.store_bps == 0.0
    assert r.evictions_per_s == 10.0
    # A source that restarted (counters went down) counts from zero again.
    restarted = rates(after, cpu(13.0, hits=1, misses=1, evicted=0, loaded=0))["CPU"]
    assert restarted.hit_rate == 0.5 and restarted.evictions_per_s == 0.0
    # The first sample has no interval: totals since start, no per-second figures.
    first = rates(None, before)["CPU"]
    assert first.hit_rate == 0.5 and first.evictions_per_s is None and first.load_bps == 0.0


def test_plain_lines_show_what_is_known_and_dashes_for_the_rest() -> None:
    before = cpu(0.0, hits=0, misses=0, evicted=0, loaded=0)
    after = cpu(1.0, hits=3, misses=1, evicted=2, loaded=2_500_000_000)
    disk = Totals(at=1.0, tiers={"DISK": TierTotals(medium="DISK", checksum_failures=2,
                                                    breaker_state="open")})
    (line,) = format_lines(rates(before, after))
    assert line.startswith("CPU ")
    assert "hit  75.0% (total 75.0%)" in line
    assert "load   2.50 GB/s" in line
    assert "pool 6/8 blocks (75.0%)" in line
    assert "evicted 2  (2/s)" in line
    (disk_line,) = format_lines(rates(None, disk))
    assert "hit      - (total -)" in disk_line
    assert "checksum failures 2" in disk_line and "breaker open" in disk_line
