"""Prometheus metrics, scraped over real HTTP from a server started in the test.

The workload is known block for block, so every value in the exposition is
checked against what it must be, not just for presence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import threading
import urllib.request
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest, push_to_gateway
from prometheus_client.parser import text_string_to_metric_families

from aiokvo import Offloader
from aiokvo.errors import ConfigError
from aiokvo.manager.retention import RetentionStatistics
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.offloader.control import ControlStatistics
from aiokvo.offloader.results import OffloaderStatistics
from aiokvo.telemetry.prometheus import (
    METRICS,
    MetricsServer,
    OffloadMetrics,
    start_metrics_server,
    totals_from_text,
)
from aiokvo.tiers import BreakerStatistics, TierStatistics
from tests.offloader._harness import KV, Copies, keys
from tests.telemetry.scrape import known_workload, parse, scrape, value


@pytest.mark.both_loops
async def test_a_real_scrape_reports_the_known_workload(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    page = kv.caches.page_bytes_per_block
    async with start_metrics_server(off, 0) as server:
        assert isinstance(server, MetricsServer) and server.port > 0
        await known_workload(off, kv)
        text = await scrape(server.url)
    s = parse(text)
    cpu = {"medium": "CPU"}
    assert value(s, "aiokvo_lookups_total", **cpu) == 1
    assert value(s, "aiokvo_hit_blocks_total", **cpu) == 4
    assert value(s, "aiokvo_miss_blocks_total", **cpu) == 2
    assert value(s, "aiokvo_stored_blocks_total", **cpu) == 12
    assert value(s, "aiokvo_loaded_blocks_total", **cpu) == 4
    assert value(s, "aiokvo_evicted_blocks_total", **cpu) == 4
    assert value(s, "aiokvo_pool_capacity_blocks", **cpu) == 8
    assert value(s, "aiokvo_pool_used_blocks", **cpu) == 8
    assert value(s, "aiokvo_pool_usage_ratio", **cpu) == 1.0
    assert value(s, "aiokvo_pool_capacity_bytes", **cpu) == 8 * page
    for direction, transfers, blocks in (("store", 2, 12), ("load", 1, 4)):
        way = {"direction": direction, "medium": "CPU"}
        assert value(s, "aiokvo_transfers_total", **way) == transfers
        assert value(s, "aiokvo_transfer_failures_total", **way) == 0
        assert value(s, "aiokvo_transfer_bytes_total", **way) == blocks * page
        assert value(s, "aiokvo_transfers_in_flight", **way) == 0
        # The histograms (from the result tap) agree with the handlers' counters.
        assert value(s, "aiokvo_transfer_seconds_count", **way) == transfers
        assert value(s, "aiokvo_transfer_seconds_bucket", **way, le="+Inf") == transfers
        assert value(s, "aiokvo_transfer_seconds_sum", **way) == pytest.approx(
            value(s, "aiokvo_transfer_copy_seconds_total", **way)
        )
        assert value(s, "aiokvo_transfer_size_bytes_sum", **way) == blocks * page
    # Blocks are 128 bytes here: both stores fall in the first (64 KiB) bucket.
    assert value(s, "aiokvo_transfer_size_bytes_bucket", direction="store", medium="CPU",
                 le="65536.0") == 2
    assert value(s, "aiokvo_event_blocks_total", medium="CPU", event="stored") == 12
    assert value(s, "aiokvo_event_blocks_total", medium="CPU", event="removed") == 4
    assert value(s, "aiokvo_dropped_events_total", consumer="metrics") == 0
    assert value(s, "aiokvo_dropped_results_total", consumer="metrics") == 0
    assert value(s, "aiokvo_offloader_calls_total", call="load_prefix") == 1
    assert value(s, "aiokvo_offloader_calls_total", call="store") == 2
    assert value(s, "aiokvo_metrics_stale_scrapes_total") == 0
    # Every family in the exposition is one of the documented ones.
    names = {f.name for f in text_string_to_metric_families(text)}
    documented = {m.name.removesuffix("_total") for m in METRICS}
    # ... or made from a documented field: the cache-control and retention counters.
    documented |= {f"aiokvo_control_{f.name}" for f in dataclasses.fields(ControlStatistics)}
    documented |= {f"aiokvo_retention_{f.name}" for f in dataclasses.fields(RetentionStatistics)}
    assert names <= documented
    assert "aiokvo_control_prefetches" in names and "aiokvo_retention_budget_blocks" in names
    # The live view's reading of the same text agrees with the collector's own totals.
    back = totals_from_text(text)
    assert back.tiers["CPU"] == server.metrics.totals().tiers["CPU"]
    assert back.transfer("store", "CPU").bytes == 12 * page


async def test_failed_copies_are_counted_per_direction(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, _, copies = offloader
    ks = keys("a", "b", "c")
    metrics = OffloadMetrics(off, CollectorRegistry())
    copies.fail_next = 1
    assert (await off.store(ks, [0, 1, 2])).failed == tuple(ks)
    s = parse(generate_latest(metrics.registry).decode())
    assert value(s, "aiokvo_transfer_failures_total", direction="store", medium="CPU") == 1
    assert value(s, "aiokvo_failed_blocks_total", direction="store", medium="CPU") == 3
    assert value(s, "aiokvo_pool_used_blocks", medium="CPU") == 0  # released again
    # A failed copy has no size or time worth a histogram.
    assert ("aiokvo_transfer_seconds_count",
            frozenset({"direction": "store", "medium": "CPU"}.items())) not in s
    await metrics.aclose()


async def test_a_callers_registry_keeps_its_own_metrics_and_refuses_a_duplicate(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    registry = CollectorRegistry()
    requests = Counter("app_requests", "the caller's own", registry=registry)
    requests.inc(3)
    async with OffloadMetrics(off, registry, labels={"rank": "1"}) as metrics:
        assert metrics.registry is registry
        await known_workload(off, kv)
        with pytest.raises(ConfigError, match="already has these metric names"):
            OffloadMetrics(off, registry)
        s = parse(generate_latest(registry).decode())
        assert value(s, "app_requests_total") == 3
        assert value(s, "aiokvo_hit_blocks_total", medium="CPU", rank="1") == 4
        # The constant label is on every aiokvo series.
        assert all(dict(labels).get("rank") == "1"
                   for name, labels in s if name.startswith("aiokvo_"))
    s = parse(generate_latest(registry).decode())
    assert not any(name.startswith("aiokvo_") for name, _ in s)  # unregistered on close
    assert value(s, "app_requests_total") == 3
    OffloadMetrics(off, registry).close()  # the names are free again


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NewTierStatistics(TierStatistics):
    """A new tier's statistics: the common fields, plus counters of its own."""

    compactions: int = 0
    """Times the store compacted its log."""
    open_segments: int = 0
    """Segments open now."""

    GAUGES: ClassVar[frozenset[str]] = TierStatistics.GAUGES | {"open_segments"}


class TieredSource:
    """An Offloader whose snapshot carries ``tiers`` (and where hits came from)."""

    def __init__(
        self, off: Offloader, *tiers: TierStatistics, hits: dict[str, int] | None = None
    ) -> None:
        self._off, self._tiers, self._hits = off, tiers, hits
        self.worker = off.worker
        self.subscribe = off.subscribe

    def statistics(self) -> OffloaderStatistics:
        snapshot = dataclasses.replace(self._off.statistics(), tiers=self._tiers)
        if self._hits is not None:
            snapshot = dataclasses.replace(snapshot, hits_by_medium=self._hits)
        return snapshot


async def test_a_tier_and_its_own_counters_appear_without_new_code(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    disk = NewTierStatistics(
        medium="LOG", capacity_blocks=100, used_blocks=40, lookups=9, lookup_hits=5,
        blocks_read=5, blocks_written=40, evictions=2, checksum_failures=1, offers=50,
        capacity_bytes=100 << 20, used_bytes=40 << 20, compactions=3, open_segments=2,
        failure_causes={"corrupt": 1}, breaker=BreakerStatistics(state="open", rejected=6),
    )
    source = TieredSource(off, disk)

    def other_pool() -> ManagerStatistics:  # another pool passed by hand, as a callable
        return ManagerStatistics(num_blocks=10, used_blocks=1, lookups=2, lookup_hits=1)

    async with start_metrics_server(source, 0, tiers={"SHARED": other_pool}) as server:
        await known_workload(off, kv)
        s = parse(await scrape(server.url))
    d = {"medium": "LOG"}
    assert value(s, "aiokvo_lookups_total", **d) == 9
    assert value(s, "aiokvo_stored_blocks_total", **d) == 40
    assert value(s, "aiokvo_evicted_blocks_total", **d) == 2
    assert value(s, "aiokvo_loaded_blocks_total", **d) == 5
    assert value(s, "aiokvo_checksum_failures_total", **d) == 1
    assert value(s, "aiokvo_pool_usage_ratio", **d) == 0.4
    assert value(s, "aiokvo_pool_used_bytes", **d) == 40 << 20
    assert value(s, "aiokvo_breaker_state", **d, state="open") == 1
    assert value(s, "aiokvo_breaker_state", **d, state="closed") == 0
    # Every other field of the snapshot, by its own name: counters and gauges alike.
    assert value(s, "aiokvo_tier_offers_total", **d) == 50
    assert value(s, "aiokvo_tier_compactions_total", **d) == 3
    assert value(s, "aiokvo_tier_open_segments", **d) == 2
    assert value(s, "aiokvo_tier_failed_blocks_total", **d, cause="corrupt") == 1
    assert value(s, "aiokvo_breaker_rejected_total", **d) == 6
    assert value(s, "aiokvo_lookups_total", medium="SHARED") == 2
    assert value(s, "aiokvo_hit_blocks_total", medium="SHARED") == 1
    assert value(s, "aiokvo_hit_blocks_total", medium="CPU") == 4  # the CPU tier is still there
    assert ("aiokvo_checksum_failures_total", frozenset({"medium": "CPU"}.items())) not in s


def test_a_tiers_own_counter_is_documented_by_its_field() -> None:
    from aiokvo.telemetry.prometheus import _Builder, _tier_fields

    out = _Builder(())
    _tier_fields(out, NewTierStatistics(medium="LOG", compactions=1))
    docs = {f.name: f.documentation for f in out.families()}
    assert docs["aiokvo_tier_compactions"] == "Times the store compacted its log."
    assert docs["aiokvo_tier_offers"] == (
        "Keys offered for writing (the admission filter counts them)."
    )


async def test_a_bad_tier_snapshot_is_a_config_error(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, _, _ = offloader
    metrics = OffloadMetrics(off, CollectorRegistry(), tiers={"X": lambda: {"lookups": 1}})
    with pytest.raises(ConfigError, match="TierStatistics"):
        metrics.totals()
    metrics.close()


async def test_tiers_below_the_pool_get_hits_and_misses_by_cascade(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    await known_workload(off, kv)  # 6 blocks asked for: 4 hit, 2 missed
    disk = TierStatistics(medium="DISK", capacity_blocks=50, used_blocks=10, lookups=3,
                          lookup_hits=2, blocks_read=1, blocks_written=10, read_failures=1,
                          write_failures=2, evictions=3, checksum_failures=1, timeouts=2,
                          breaker=BreakerStatistics(state="half_open", trips=4))
    remote = dataclasses.replace(disk, medium="MOONCAKE", breaker=BreakerStatistics())
    # Of the 4 hits, say 1 came from the disk and 1 from the remote tier.
    source = TieredSource(off, disk, remote, hits={"CPU": 2, "DISK": 1, "MOONCAKE": 1})
    metrics = OffloadMetrics(source, CollectorRegistry())
    s = parse(generate_latest(metrics.registry).decode())
    metrics.close()
    hits = {m: value(s, "aiokvo_hit_blocks_total", medium=m) for m in ("CPU", "DISK", "MOONCAKE")}
    misses = {m: value(s, "aiokvo_miss_blocks_total", medium=m)
              for m in ("CPU", "DISK", "MOONCAKE")}
    assert hits == {"CPU": 2, "DISK": 1, "MOONCAKE": 1}
    # The pool was asked for 6 and missed 4; the disk for those 4, missing 3; then 3 -> 2.
    assert misses == {"CPU": 4, "DISK": 3, "MOONCAKE": 2}
    d = {"medium": "DISK"}
    assert value(s, "aiokvo_pool_capacity_blocks", **d) == 50
    assert value(s, "aiokvo_loaded_blocks_total", **d) == 1
    assert value(s, "aiokvo_stored_blocks_total", **d) == 10
    assert value(s, "aiokvo_failed_blocks_total", **d, direction="load") == 1
    assert value(s, "aiokvo_failed_blocks_total", **d, direction="store") == 2
    assert value(s, "aiokvo_evicted_blocks_total", **d) == 3
    assert value(s, "aiokvo_timeouts_total", **d) == 2
    assert value(s, "aiokvo_breaker_trips_total", **d) == 4
    assert value(s, "aiokvo_breaker_state", **d, state="half_open") == 1


async def test_a_blocked_loop_gets_the_previous_snapshot_not_a_torn_one(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    async with start_metrics_server(off, 0, scrape_timeout=0.2) as server:
        await known_workload(off, kv)
        first = parse(await scrape(server.url))
        assert value(first, "aiokvo_metrics_stale_scrapes_total") == 0
        ks = keys("x", "y")
        assert (await off.store(ks, [30, 31])).ok  # not yet scraped
        # Block the loop until a scrape from another thread has returned.
        result: list[str] = []
        finished = threading.Event()

        def get() -> None:
            with urllib.request.urlopen(server.url, timeout=30) as response:
                result.append(response.read().decode())
            finished.set()

        thread = threading.Thread(target=get)
        thread.start()
        assert finished.wait(30)  # the loop is blocked here, on purpose
        thread.join()
        stale = parse(result[0])
        assert value(stale, "aiokvo_metrics_stale_scrapes_total") == 1
        assert value(stale, "aiokvo_stored_blocks_total", medium="CPU") == 12  # before x, y
        # The loop is free again: a scrape it answers has x and y. (On a loaded machine
        # one may still miss the 0.2 s and be served stale: that one is scraped again.)
        for _ in range(100):
            stale_before = server.metrics.statistics().stale_scrapes
            fresh = parse(await scrape(server.url))
            if server.metrics.statistics().stale_scrapes == stale_before:
                break
        assert value(fresh, "aiokvo_stored_blocks_total", medium="CPU") == 14


async def test_an_overflowing_result_tap_is_counted_and_the_counters_stay_exact(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    # No periodic drain during the test: only the scrape drains, after 3 results.
    metrics = OffloadMetrics(off, CollectorRegistry(), max_stream=1, stream_interval=3600)
    await known_workload(off, kv)
    s = parse(generate_latest(metrics.registry).decode())
    await metrics.aclose()
    assert value(s, "aiokvo_dropped_results_total", consumer="metrics") == 2
    assert value(s, "aiokvo_dropped_events_total", consumer="metrics") == 2  # of 3 events
    histogram_count = sum(
        v for (name, _), v in s.items() if name == "aiokvo_transfer_seconds_count"
    )
    assert histogram_count == 1  # the one result the tap kept
    stores = value(s, "aiokvo_transfers_total", direction="store", medium="CPU")
    assert stores == 2  # the snapshot counters do not depend on the tap


async def test_the_stream_task_drains_between_scrapes(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, _, _ = offloader
    async with OffloadMetrics(off, CollectorRegistry(), max_stream=1,
                              stream_interval=0.001) as metrics:
        ks = keys(*"abcdef")
        for i, k in enumerate(ks):  # one result and one event at a time
            assert (await off.store([k], [i])).ok
            while (now := metrics.statistics()).queued_results or now.queued_events:
                await asyncio.sleep(0.001)  # until the drain task has emptied both
        stats = metrics.statistics()
        assert (stats.results, stats.events, stats.scrapes) == (6, 6, 0)
        assert stats.dropped_results == stats.dropped_events == 0
        s = parse(generate_latest(metrics.registry).decode())
    assert metrics.statistics().closed
    assert value(s, "aiokvo_event_blocks_total", medium="CPU", event="stored") == 6
    assert value(s, "aiokvo_transfer_seconds_count", direction="store", medium="CPU") == 6


async def test_a_metrics_server_serves_an_existing_collector_and_leaves_it_open(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    async with OffloadMetrics(off, CollectorRegistry()) as metrics:
        server = start_metrics_server(metrics, 0, addr="127.0.0.1")
        assert repr(server).startswith("<MetricsServer serving http://127.0.0.1:")
        await known_workload(off, kv)
        s = parse(await scrape(server.url))
        assert value(s, "aiokvo_hit_blocks_total", medium="CPU") == 4
        await asyncio.to_thread(server.close)  # sync close, off the loop
        server.close()  # idempotent
        assert not metrics.closed
        with pytest.raises(OSError):
            await scrape(server.url)


async def test_a_port_in_use_raises_and_leaves_nothing_registered(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, _, _ = offloader
    registry = CollectorRegistry()
    async with start_metrics_server(off, 0) as first:
        with pytest.raises(OSError):
            start_metrics_server(off, first.port, registry=registry)
    OffloadMetrics(off, registry).close()  # nothing was left registered there


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"labels": {"medium": "x"}}, "use already"),
        ({"labels": {"1bad": "x"}}, "not a valid Prometheus label"),
        ({"labels": {"rank": 1}}, "str value"),
        ({"seconds_buckets": (1.0, 0.5)}, "strictly increasing"),
        ({"bytes_buckets": ()}, "not empty"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"scrape_timeout": "1"}, "scrape_timeout"),
        ({"max_stream": 0}, "max_stream"),
        ({"tiers": {"DISK": 3}}, "tiers\\['DISK'\\]"),
        ({"medium": ""}, "medium"),
        ({"publisher": object()}, "publisher"),
    ],
)
async def test_bad_options_raise_config_errors_naming_them(
    offloader: tuple[Offloader, KV, Copies], kwargs: dict[str, Any], match: str
) -> None:
    off, _, _ = offloader
    registry = CollectorRegistry()
    with pytest.raises(ConfigError, match=match):
        OffloadMetrics(off, registry, **kwargs)
    OffloadMetrics(off, registry).close()  # nothing was registered by the failed one


async def test_bad_sources_and_ports_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="statistics"):
        OffloadMetrics(object(), CollectorRegistry())
    with pytest.raises(ConfigError, match="port"):
        start_metrics_server(object(), 70000)
    with pytest.raises(ConfigError, match="addr"):
        start_metrics_server(object(), 0, addr="")


async def test_a_pushgateway_push_carries_the_metrics(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    """The registry is an ordinary one, so prometheus-client's push works (batch jobs)."""
    pushed: list[tuple[str, str]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            pushed.append((self.path, body.decode()))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    gateway = http.server.HTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=gateway.serve_forever)
    thread.start()
    off, kv, _ = offloader
    try:
        async with OffloadMetrics(off, CollectorRegistry()) as metrics:
            await known_workload(off, kv)
            address = f"127.0.0.1:{gateway.server_address[1]}"
            await asyncio.to_thread(push_to_gateway, address, job="replay",
                                    registry=metrics.registry)
    finally:
        gateway.shutdown()
        gateway.server_close()
        thread.join()
    ((path, body),) = pushed
    assert path == "/metrics/job/replay"
    assert value(parse(body), "aiokvo_evicted_blocks_total", medium="CPU") == 4


async def test_a_real_disk_tier_is_scraped_with_its_hits_and_blocks(disk_tier_path: Any) -> None:
    """The exporter reads a real DiskTier's snapshot: no fake, no extra code."""
    from tests.tiers.disk._util import KV as DiskKV
    from tests.tiers.disk._util import fill
    from tests.tiers.disk._util import keys as disk_keys
    from tests.tiers.disk._util import offloader as disk_offloader

    kv = DiskKV()
    ks = disk_keys("m", 12)
    async with disk_offloader(kv, disk_tier_path, cpu_blocks=8) as off:
        async with start_metrics_server(off, 0) as server:
            for i in range(0, 12, 4):  # the pool holds 8: the first 4 are only on disk
                await fill(off, kv, ks[i : i + 4], start=i)
            kv.clear(range(64))
            assert await off.load_prefix(ks[:8], list(range(20, 28))) == 8
            s = parse(await scrape(server.url))
        stats = off.statistics()
    disk = {"medium": "DISK"}
    assert stats.hits_by_medium == {"CPU": 4, "DISK": 4}
    assert value(s, "aiokvo_hit_blocks_total", **disk) == 4
    assert value(s, "aiokvo_hit_blocks_total", medium="CPU") == 4
    assert value(s, "aiokvo_pool_used_blocks", **disk) == 12
    assert value(s, "aiokvo_breaker_state", **disk, state="closed") == 1
    assert value(s, "aiokvo_checksum_failures_total", **disk) == 0


async def test_the_offloaders_promotion_and_write_through_counters_are_exported(
    disk_tier_path: Any,
) -> None:
    """A promotion the pool has no room for and a write failing part way, scraped."""
    from tests.tiers.disk._util import KV as DiskKV
    from tests.tiers.disk._util import FaultyIO, fill
    from tests.tiers.disk._util import keys as disk_keys
    from tests.tiers.disk._util import offloader as disk_offloader

    kv, io = DiskKV(), FaultyIO()
    old, new = disk_keys("o", 4), disk_keys("n", 4)
    async with disk_offloader(kv, disk_tier_path, cpu_blocks=4, file_io=io) as off:
        metrics = OffloadMetrics(off, CollectorRegistry())
        await fill(off, kv, old)
        io.fail_after_bytes = io.written + kv.caches.page_bytes_per_block  # one more fits
        await fill(off, kv, new, start=4)  # `old` leaves the pool; 1 of `new` reaches the disk
        lease = off.pin_prefix(new)
        assert lease is not None and lease.count == 4
        assert await off.load_prefix(old, [20, 21, 22, 23]) == 0  # no room to promote into
        s = parse(generate_latest(metrics.registry).decode())
        stats = off.statistics()
        lease.release()
        metrics.close()
    assert value(s, "aiokvo_offloader_promotions_no_room_total") == stats.promotions_no_room == 1
    (tier,) = stats.tiers  # counted once, by the tier: its reads are the promotions
    assert value(s, "aiokvo_offloader_promotions_total") == tier.reads == 0
    assert value(s, "aiokvo_offloader_promotion_timeouts_total") == 0
    assert value(s, "aiokvo_offloader_tier_writes_skipped_blocks_total") == 0
    disk = {"medium": "DISK"}
    assert value(s, "aiokvo_stored_blocks_total", **disk) == tier.blocks_written == 5
    assert value(s, "aiokvo_failed_blocks_total", **disk, direction="store") == 3
    assert tier.write_failures == 3
    assert value(s, "aiokvo_tier_writes_total", **disk) == tier.writes == 2
    assert value(s, "aiokvo_tier_bytes_written_total", **disk) == tier.bytes_written
