"""Per-tier totals and rates (aiokvo.telemetry.stats): pure arithmetic on snapshots."""

from __future__ import annotations

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
from aiokvo.tiers import BreakerStatistics, TierStatistics


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


def test_a_tiers_totals_are_read_from_its_typed_snapshot() -> None:
    stats = TierStatistics(
        medium="DISK", capacity_blocks=10, used_blocks=5, lookups=3, lookup_hits=7,
        blocks_read=2, blocks_written=6, evictions=4, write_failures=1, read_failures=2,
        checksum_failures=1, timeouts=3, breaker=BreakerStatistics(state="half_open", trips=2),
    )
    t = tier_totals(stats)
    assert t.medium == "DISK"
    assert (t.lookups, t.hit_blocks, t.miss_blocks) == (3, 7, None)  # misses: the Offloader's
    assert (t.loaded_blocks, t.stored_blocks, t.evicted_blocks) == (2, 6, 4)
    assert (t.load_failed_blocks, t.store_failed_blocks) == (2, 1)
    assert (t.num_blocks, t.used_blocks, t.usage) == (10, 5, 0.5)
    assert (t.checksum_failures, t.timeouts) == (1, 3)
    assert (t.breaker_state, t.breaker_trips) == ("half_open", 2)
    assert (t.capacity_bytes, t.used_bytes) == (None, None)  # unknown, not zero


def test_a_snapshot_that_is_not_a_tiers_or_a_managers_is_refused() -> None:
    manager = ManagerStatistics(num_blocks=4)
    with pytest.raises(TypeError, match="snapshot"):
        totals_from_statistics(manager, tiers={"X": object()})  # type: ignore[dict-item]


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
