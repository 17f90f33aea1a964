"""Prometheus metrics for aiokvo, read from ``statistics()`` snapshots at scrape time.

``OffloadMetrics(offloader, registry)`` registers one collector in a
prometheus-client registry; ``start_metrics_server(offloader, 9400)`` serves a
registry of its own over HTTP. Nothing runs on the hot path:

* **At scrape time** the collector takes the source's snapshot (an Offloader's
  includes its manager, worker, handlers and poller), any extra tiers' and a
  KV-event publisher's, and turns them into metric families. Tiers are read
  generically (:mod:`aiokvo.telemetry.stats`), so a tier whose statistics use
  the field names there is exported with no new code. Snapshots are taken on
  the event loop's thread: a scrape from the HTTP server's thread hands the
  snapshot to the loop and waits for it (``scrape_timeout``), so it never reads
  structures the loop is changing; a loop that does not answer in time gets
  the previous snapshot served (``aiokvo_metrics_stale_scrapes_total``).
* **From the streams**, what snapshots cannot say: a result tap on the worker
  (:meth:`~aiokvo.handlers.worker.OffloadingWorker.tap_results`) gives the
  per-transfer time and size histograms, an event subscription the blocks
  stored and removed per medium. Both are bounded buffers the hot path only
  appends to; a task on the loop drains them every ``stream_interval``
  seconds, and every scrape drains them too.

Names follow Prometheus conventions (base units in the name, ``_total`` on
counters, a ``medium`` label per tier, ``direction`` = ``load`` / ``store``
per transfer); docs/telemetry.md lists them with vLLM's, LMCache's and
SGLang's equivalents, and what works in prometheus-client's multiprocess mode.
Needs the ``prometheus`` extra (``pip install 'aiokvo[prometheus]'``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.exposition import start_http_server
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "aiokvo.telemetry.prometheus needs prometheus-client: pip install 'aiokvo[prometheus]'"
    ) from exc

from aiokvo._util import AsyncResource, check_int, field_docs
from aiokvo.errors import ConfigError
from aiokvo.events import Lagged
from aiokvo.manager.retention import RetentionStatistics
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.offloader.control import ControlStatistics
from aiokvo.telemetry.stats import (
    Direction,
    TierTotals,
    Totals,
    TransferTotals,
    totals_from_statistics,
    transfer_direction,
)
from aiokvo.tiers.base import TierStatistics

__all__ = [
    "DEFAULT_BYTES_BUCKETS",
    "DEFAULT_SECONDS_BUCKETS",
    "METRICS",
    "MetricSpec",
    "MetricsServer",
    "OffloadMetrics",
    "OffloadMetricsStatistics",
    "start_metrics_server",
    "totals_from_text",
]

DEFAULT_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Transfer-time buckets: 100 us (one small host copy) to 10 s (a stuck disk)."""

DEFAULT_BYTES_BUCKETS: tuple[float, ...] = tuple(float(1 << s) for s in range(16, 32, 2))
"""Transfer-size buckets: 64 KiB to 1 GiB, by factors of 4."""

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported family: its kind, name as scraped, help text and labels."""

    kind: Kind
    name: str
    doc: str
    labels: tuple[str, ...] = ()


_M, _MD, _DM = ("medium",), ("medium", "direction"), ("direction", "medium")

METRICS: tuple[MetricSpec, ...] = (
    # tiers
    MetricSpec("counter", "aiokvo_lookups_total", "Lookup calls answered by the tier.", _M),
    MetricSpec("counter", "aiokvo_hit_blocks_total", "Blocks found ready (the hit prefix).", _M),
    MetricSpec("counter", "aiokvo_miss_blocks_total", "Blocks asked for past the hit prefix.", _M),
    MetricSpec("counter", "aiokvo_stored_blocks_total", "Blocks stored and made readable.", _M),
    MetricSpec("counter", "aiokvo_loaded_blocks_total", "Blocks loaded towards the GPU.", _M),
    MetricSpec("counter", "aiokvo_evicted_blocks_total", "Blocks evicted to make room.", _M),
    MetricSpec("counter", "aiokvo_failed_blocks_total", "Blocks whose copy failed.", _MD),
    MetricSpec("counter", "aiokvo_refused_stores_total", "Stores that found no room at all.", _M),
    MetricSpec("counter", "aiokvo_checksum_failures_total",
               "Blocks read back wrong (dropped and served as misses).", _M),
    MetricSpec("counter", "aiokvo_timeouts_total", "Transfers past their deadline.", _M),
    MetricSpec("counter", "aiokvo_breaker_trips_total", "Times the breaker opened.", _M),
    MetricSpec("gauge", "aiokvo_breaker_state",
               "The tier's circuit breaker: 1 for its current state.", ("medium", "state")),
    MetricSpec("gauge", "aiokvo_pool_capacity_blocks", "Blocks the tier can hold.", _M),
    MetricSpec("gauge", "aiokvo_pool_used_blocks", "Blocks held (ready or being written).", _M),
    MetricSpec("gauge", "aiokvo_pool_pinned_blocks", "Blocks with a load pending.", _M),
    MetricSpec("gauge", "aiokvo_pool_writing_blocks", "Blocks being written.", _M),
    MetricSpec("gauge", "aiokvo_pool_usage_ratio", "Used over capacity (0..1).", _M),
    MetricSpec("gauge", "aiokvo_pool_capacity_bytes", "Bytes the tier can hold.", _M),
    MetricSpec("gauge", "aiokvo_pool_used_bytes", "Bytes held.", _M),
    # transfers
    MetricSpec("counter", "aiokvo_transfers_total", "Transfers finished.", _DM),
    MetricSpec("counter", "aiokvo_transfer_failures_total", "Transfers that failed.", _DM),
    MetricSpec("counter", "aiokvo_transfer_bytes_total", "Bytes moved by successful transfers.",
               _DM),
    MetricSpec("counter", "aiokvo_transfer_copy_seconds_total",
               "Copy time of successful transfers, summed.", _DM),
    MetricSpec("gauge", "aiokvo_transfers_in_flight", "Transfers submitted and not finished.",
               _DM),
    MetricSpec("histogram", "aiokvo_transfer_seconds", "Copy time of one successful transfer.",
               _DM),
    MetricSpec("histogram", "aiokvo_transfer_size_bytes", "Size of one successful transfer.",
               _DM),
    # streams
    MetricSpec("counter", "aiokvo_event_blocks_total",
               "Blocks in cache events, by medium and event (stored, removed).",
               ("medium", "event")),
    MetricSpec("counter", "aiokvo_dropped_events_total",
               "Cache events a bounded subscription dropped, by consumer.", ("consumer",)),
    MetricSpec("counter", "aiokvo_dropped_results_total",
               "Transfer results dropped unread, by consumer.", ("consumer",)),
    # the Offloader and its parts
    MetricSpec("counter", "aiokvo_offloader_calls_total", "Offloader calls.", ("call",)),
    MetricSpec("counter", "aiokvo_offloader_leases_total", "pin_prefix calls that pinned blocks."),
    MetricSpec("gauge", "aiokvo_offloader_active_leases", "Leases holding pins now."),
    MetricSpec("counter", "aiokvo_offloader_store_waits_total",
               "Loads that waited for a store of their prefix in flight."),
    MetricSpec("counter", "aiokvo_offloader_cancelled_waits_total",
               "Calls cancelled while their copy went on."),
    MetricSpec("gauge", "aiokvo_offloader_waiters", "Coroutines waiting for stores in flight."),
    MetricSpec("counter", "aiokvo_offloader_promotions_total",
               "Promotions started: tier-to-CPU transfers for a load."),
    MetricSpec("counter", "aiokvo_offloader_promotion_timeouts_total",
               "Promotions a load stopped waiting for (past their tier's io_timeout)."),
    MetricSpec("counter", "aiokvo_offloader_promotions_no_room_total",
               "Promotions not started: the CPU pool had no room once the tier answered."),
    MetricSpec("counter", "aiokvo_offloader_tier_writes_skipped_blocks_total",
               "Blocks not written through: the tier's writes in flight pinned its share."),
    MetricSpec("counter", "aiokvo_reuse_filtered_blocks_total",
               "Blocks the reuse filter kept from being stored."),
    MetricSpec("gauge", "aiokvo_reuse_tracked_keys", "Keys the reuse filter counts now."),
    MetricSpec("counter", "aiokvo_submit_failures_total", "Transfers a handler failed to enqueue."),
    MetricSpec("gauge", "aiokvo_poller_pending", "Completions watched and not yet reported."),
    MetricSpec("gauge", "aiokvo_poller_threads", "Completion waiter threads alive."),
    MetricSpec("counter", "aiokvo_poller_callback_errors_total",
               "Completion callbacks that raised."),
    # a KV-event publisher
    MetricSpec("counter", "aiokvo_kv_event_batches_total", "KV-event batches published."),
    MetricSpec("counter", "aiokvo_kv_events_sent_total", "KV events published."),
    MetricSpec("counter", "aiokvo_kv_event_send_errors_total", "KV-event batches that failed."),
    MetricSpec("counter", "aiokvo_kv_event_replays_total", "KV-event replay requests answered."),
    MetricSpec("gauge", "aiokvo_kv_event_buffer_bytes", "Payload bytes kept for replay."),
    # the exporter itself
    MetricSpec("counter", "aiokvo_metrics_stale_scrapes_total",
               "Scrapes served the previous snapshot because the loop did not answer in time."),
)
"""Every family aiokvo exports, as scraped (docs/telemetry.md has the mapping to peers')."""

_SPECS = {spec.name: spec for spec in METRICS}
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_BREAKER_STATES = ("closed", "open", "half_open")


# -- the streams ----------------------------------------------------------------------


class _Histogram:
    """Fixed buckets, cumulative on read (Prometheus ``le`` semantics: v <= bound)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def read(self) -> tuple[list[tuple[str, float]], float]:
        buckets, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return buckets, self.total


class _Streams:
    """What the result tap and the event subscription added up (loop thread only)."""

    def __init__(self, seconds_buckets: tuple[float, ...], bytes_buckets: tuple[float, ...]):
        self._seconds_buckets = seconds_buckets
        self._bytes_buckets = bytes_buckets
        self.seconds: dict[tuple[Direction, str], _Histogram] = {}
        self.sizes: dict[tuple[Direction, str], _Histogram] = {}
        self.event_blocks: dict[tuple[str, str], int] = {}
        self._directions: dict[tuple[str, str], tuple[Direction, str]] = {}

    def add_results(self, results: Iterable[Any]) -> None:
        for result in results:
            if not result.success or result.transfer_type is None:
                continue  # failures are counted from the handlers' snapshots
            key = self._directions.get(result.transfer_type)
            if key is None:
                key = self._directions[result.transfer_type] = transfer_direction(
                    result.transfer_type
                )
                self.seconds[key] = _Histogram(self._seconds_buckets)
                self.sizes[key] = _Histogram(self._bytes_buckets)
            if result.transfer_time is not None:
                self.seconds[key].observe(result.transfer_time)
            if result.transfer_size is not None:
                self.sizes[key].observe(float(result.transfer_size))

    def add_events(self, items: Iterable[Any]) -> None:
        counts = self.event_blocks
        for item in items:
            if isinstance(item, Lagged):
                continue  # counted by the subscription (dropped)
            key = (item.medium, "removed" if item.removed else "stored")
            counts[key] = counts.get(key, 0) + len(item.keys)

    def read(self) -> _StreamState:
        return _StreamState(
            seconds={k: h.read() for k, h in self.seconds.items()},
            sizes={k: h.read() for k, h in self.sizes.items()},
            event_blocks=dict(self.event_blocks),
        )


_HistogramRead = tuple[list[tuple[str, float]], float]


@dataclass(frozen=True, slots=True)
class _StreamState:
    seconds: dict[tuple[Direction, str], _HistogramRead] = field(default_factory=dict)
    sizes: dict[tuple[Direction, str], _HistogramRead] = field(default_factory=dict)
    event_blocks: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Scrape:
    """Everything one scrape exports, taken on the loop's thread in one go."""

    stats: Any
    totals: Totals
    tier_snapshots: tuple[TierStatistics, ...]
    streams: _StreamState
    publisher: Any
    dropped_events: int | None
    dropped_results: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadMetricsStatistics:
    """An :class:`OffloadMetrics` now, and its scrapes and stream drains so far."""

    scrapes: int = 0
    """Scrapes collected."""
    stale_scrapes: int = 0
    """Scrapes that served the previous snapshot."""
    drains: int = 0
    """Drains of the result and event streams."""
    results: int = 0
    """Transfer results the drains brought in."""
    events: int = 0
    """Manager events the drains brought in."""
    queued_results: int = 0
    """Results waiting for the next drain."""
    queued_events: int = 0
    """Events waiting for the next drain."""
    dropped_results: int = 0
    """Results lost to a full buffer (``max_stream``)."""
    dropped_events: int = 0
    """Events lost to a full buffer (``max_stream``)."""
    closed: bool = False
    """``close()`` ran: the collector is unregistered and the streams detached."""


# -- the collector --------------------------------------------------------------------


class OffloadMetrics(AsyncResource):
    """aiokvo's metrics for ``source``, registered in ``registry`` (prometheus-client's
    default ``REGISTRY`` when None).

    ``source`` is an :class:`~aiokvo.Offloader` (or a manager, or a worker):
    anything with ``statistics()``; with ``subscribe()`` its events and with a
    ``worker`` (or ``tap_results()``) its results feed the stream metrics.
    ``tiers`` adds tiers by medium (objects with ``statistics()``, or
    callables returning a snapshot), next to those the source's snapshot
    carries in ``tiers``; ``publisher`` a :class:`~aiokvo.telemetry.kv_events.
    KVEventPublisher` whose counters to export. ``medium`` names the source's
    own pool (``"CPU"``). ``labels`` are constant labels put on every series
    (``{"rank": "0"}``, to tell processes apart behind one Prometheus job).

    The collector works at once; the stream task starts on the running loop
    (here, or at ``await start()``), and every scrape drains the streams as
    well. ``close()`` / ``aclose()`` (``async with``) unregisters it and
    detaches the streams. Registering a second ``OffloadMetrics`` in the same
    registry raises :class:`~aiokvo.errors.ConfigError` (the names collide):
    use a registry per source, or ``labels`` with one registry per process.
    """

    def __init__(
        self,
        source: Any,
        registry: CollectorRegistry | None = None,
        *,
        tiers: Mapping[str, Any] | None = None,
        publisher: Any = None,
        medium: str = "CPU",
        labels: Mapping[str, str] | None = None,
        seconds_buckets: Sequence[float] = DEFAULT_SECONDS_BUCKETS,
        bytes_buckets: Sequence[float] = DEFAULT_BYTES_BUCKETS,
        stream_interval: float = 0.25,
        max_stream: int = 65_536,
        scrape_timeout: float = 2.0,
    ) -> None:
        if not callable(getattr(source, "statistics", None)):
            raise ConfigError(f"source must have a statistics() method, got {source!r}")
        if publisher is not None and not callable(getattr(publisher, "statistics", None)):
            raise ConfigError(f"publisher must have a statistics() method, got {publisher!r}")
        if not isinstance(medium, str) or not medium:
            raise ConfigError(f"medium must be a non-empty str, got {medium!r}")
        self._tiers = _check_tiers(tiers)
        self._const = _check_labels(labels)
        self._seconds_buckets = _check_buckets("seconds_buckets", seconds_buckets)
        self._bytes_buckets = _check_buckets("bytes_buckets", bytes_buckets)
        self._interval = _check_seconds("stream_interval", stream_interval, minimum=0.001)
        self._timeout = _check_seconds("scrape_timeout", scrape_timeout, minimum=0.0)
        max_stream = check_int("max_stream", max_stream, minimum=1)
        self._source = source
        self._publisher = publisher
        self._medium = medium
        config = getattr(source, "config", None)
        block_bytes = getattr(config, "kv_bytes_per_offloaded_block", None)
        self._block_bytes = block_bytes if isinstance(block_bytes, int) else None
        self._registry: CollectorRegistry = REGISTRY if registry is None else registry
        self._streams = _Streams(self._seconds_buckets, self._bytes_buckets)
        self._lock = threading.Lock()  # scrapes from several server threads take turns
        self._last: _Scrape | None = None
        self._stale = self._scrapes = self._drains = self._results = self._events = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._subscription: Any = None
        self._tap: Any = None
        subscribe = getattr(source, "subscribe", None)
        if callable(subscribe):
            self._subscription = subscribe(maxsize=max_stream, overflow="drop_oldest")
        worker = getattr(source, "worker", source)
        tap_results = getattr(worker, "tap_results", None)
        try:
            if callable(tap_results):
                self._tap = tap_results(maxsize=max_stream)
            self._collector = _Collector(self)
            try:
                self._registry.register(self._collector)
            except ValueError as exc:  # prometheus-client's duplicate-name error
                raise ConfigError(
                    f"registry {self._registry!r} already has these metric names ({exc}); "
                    "give each OffloadMetrics its own registry"
                ) from exc
        except BaseException:
            self._detach()
            raise
        with contextlib.suppress(RuntimeError):
            self._start_on(asyncio.get_running_loop())

    # -- lifetime ---------------------------------------------------------------------

    async def start(self) -> None:
        """Drain the streams periodically on the running loop (idempotent)."""
        if self._closed:
            raise ConfigError("this OffloadMetrics is closed; make a new one")
        self._start_on(asyncio.get_running_loop())

    def _start_on(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None:
            self._loop = loop
            self._task = loop.create_task(self._drain_forever(), name="aiokvo-metrics-streams")

    def close(self) -> None:
        """Unregister from the registry and detach the streams (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(KeyError):
            self._registry.unregister(self._collector)
        self._detach()
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the stream task to end."""
        self.close()
        task = self._task
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _detach(self) -> None:
        for stream in (self._subscription, self._tap):
            if stream is not None:
                stream.close()

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the collector is registered in."""
        return self._registry

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the streams ------------------------------------------------------------------

    async def _drain_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self._drain()

    def _drain(self) -> None:
        self._drains += 1
        if self._tap is not None:
            results = self._tap.drain_nowait()
            self._results += len(results)
            self._streams.add_results(results)
        if self._subscription is not None:
            items = self._subscription.drain_nowait()
            self._events += len(items)
            self._streams.add_events(items)

    def statistics(self) -> OffloadMetricsStatistics:
        """A snapshot of this exporter (see :class:`OffloadMetricsStatistics`)."""
        tap, sub = self._tap, self._subscription
        return OffloadMetricsStatistics(
            scrapes=self._scrapes,
            stale_scrapes=self._stale,
            drains=self._drains,
            results=self._results,
            events=self._events,
            queued_results=0 if tap is None else tap.qsize(),
            queued_events=0 if sub is None else sub.qsize(),
            dropped_results=0 if tap is None else tap.dropped,
            dropped_events=0 if sub is None else sub.dropped,
            closed=self._closed,
        )

    # -- scrapes ----------------------------------------------------------------------

    def totals(self) -> Totals:
        """The per-tier totals a scrape would export now (from any thread).

        Off the loop's thread this waits for the loop as a scrape does, and
        raises :class:`TimeoutError` if it does not answer and nothing was
        taken before.
        """
        with self._lock:
            scrape = self._snapshot()
        if scrape is None:
            raise TimeoutError(f"the event loop did not answer within {self._timeout} s")
        return scrape.totals

    def _take(self) -> _Scrape:
        """One consistent snapshot of everything; runs on the loop's thread."""
        self._drain()
        stats = self._source.statistics()
        tiers: dict[str, TierStatistics | ManagerStatistics] = {}
        for name, read in self._tiers.items():
            snapshot = read()
            if not isinstance(snapshot, TierStatistics | ManagerStatistics):
                raise ConfigError(
                    f"tiers[{name!r}] gave {snapshot!r}: a tier's statistics() "
                    "(TierStatistics) or a manager's (ManagerStatistics) is expected"
                )
            tiers[name] = snapshot
        totals = totals_from_statistics(
            stats, medium=self._medium, block_bytes=self._block_bytes, tiers=tiers
        )
        own = tuple(getattr(stats, "tiers", ()))
        extra = tuple(t for t in tiers.values() if isinstance(t, TierStatistics))
        return _Scrape(
            stats=stats,
            totals=totals,
            tier_snapshots=own + extra,
            streams=self._streams.read(),
            publisher=None if self._publisher is None else self._publisher.statistics(),
            dropped_events=None if self._subscription is None else self._subscription.dropped,
            dropped_results=None if self._tap is None else self._tap.dropped,
        )

    def _snapshot(self) -> _Scrape | None:
        """:meth:`_take` on the loop's thread; the previous one if the loop is too slow."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running() or _on(loop):
            scrape = self._take()
        else:
            done: concurrent.futures.Future[_Scrape] = concurrent.futures.Future()

            def take() -> None:
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(self._take())
                    except BaseException as exc:
                        done.set_exception(exc)

            try:
                loop.call_soon_threadsafe(take)
                scrape = done.result(self._timeout)
            except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError):
                done.cancel()
                self._stale += 1
                return self._last
        self._last = scrape
        return scrape

    def collect(self) -> list[Metric]:
        """The metric families now (what the registry's collector returns)."""
        with self._lock:
            scrape = self._snapshot()
            self._scrapes += 1
            stale = self._stale
        return _families(scrape, stale, self._const)


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class _Collector:
    """What the registry holds: collects through its :class:`OffloadMetrics`."""

    def __init__(self, metrics: OffloadMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics.collect()

    def describe(self) -> Iterable[Metric]:
        # With describe(), a plain CollectorRegistry knows the names and refuses duplicates.
        return _Builder(self._metrics._const).families()


# -- families -------------------------------------------------------------------------


class _Builder:
    """Families for every spec, filled sample by sample (None values are skipped)."""

    def __init__(self, const: tuple[tuple[str, str], ...]) -> None:
        self._const_names = tuple(name for name, _ in const)
        self._const_values = tuple(value for _, value in const)
        self._families: dict[str, Metric] = {}
        for spec in METRICS:
            labels = [*spec.labels, *self._const_names]
            base = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
            family: Metric
            if spec.kind == "counter":
                family = CounterMetricFamily(base, spec.doc, labels=labels)
            elif spec.kind == "gauge":
                family = GaugeMetricFamily(base, spec.doc, labels=labels)
            else:
                family = HistogramMetricFamily(base, spec.doc, labels=labels)
            self._families[spec.name] = family

    def add(self, name: str, value: float | None, *labels: str) -> None:
        if value is None:
            return
        family = self._families[name]
        assert isinstance(family, CounterMetricFamily | GaugeMetricFamily)
        family.add_metric([*labels, *self._const_values], float(value))

    def add_dynamic(
        self, kind: Kind, name: str, doc: str, label_names: tuple[str, ...], value: float,
        *labels: str,
    ) -> None:  # fmt: skip
        """A sample of a family not in :data:`METRICS` (made on first use): a tier's
        own fields, whose names come from its statistics."""
        family = self._families.get(name)
        if family is None:
            names = [*label_names, *self._const_names]
            if kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=names)
            else:
                family = GaugeMetricFamily(name, doc, labels=names)
            self._families[name] = family
        assert isinstance(family, CounterMetricFamily | GaugeMetricFamily)
        family.add_metric([*labels, *self._const_values], float(value))

    def add_histogram(self, name: str, read: _HistogramRead, *labels: str) -> None:
        family = self._families[name]
        assert isinstance(family, HistogramMetricFamily)
        buckets, total = read
        family.add_metric([*labels, *self._const_values], buckets, total)

    def families(self) -> list[Metric]:
        return list(self._families.values())


def _families(
    scrape: _Scrape | None, stale: int, const: tuple[tuple[str, str], ...]
) -> list[Metric]:
    out = _Builder(const)
    out.add("aiokvo_metrics_stale_scrapes_total", stale)
    if scrape is None:
        return out.families()
    for medium, tier in scrape.totals.tiers.items():
        _tier(out, medium, tier)
    for snapshot in scrape.tier_snapshots:
        _tier_fields(out, snapshot)
    for (direction, medium), way in scrape.totals.transfers.items():
        _transfer(out, direction, medium, way)
    streams = scrape.streams
    for (direction, medium), read in streams.seconds.items():
        out.add_histogram("aiokvo_transfer_seconds", read, direction, medium)
    for (direction, medium), read in streams.sizes.items():
        out.add_histogram("aiokvo_transfer_size_bytes", read, direction, medium)
    for (medium, event), blocks in streams.event_blocks.items():
        out.add("aiokvo_event_blocks_total", blocks, medium, event)
    out.add("aiokvo_dropped_events_total", scrape.dropped_events, "metrics")
    out.add("aiokvo_dropped_results_total", scrape.dropped_results, "metrics")
    _parts(out, scrape.stats)
    publisher = scrape.publisher
    if publisher is not None:
        out.add("aiokvo_dropped_events_total", _int(publisher, "events_dropped"), "kv_events")
        out.add("aiokvo_kv_event_batches_total", _int(publisher, "batches_sent"))
        out.add("aiokvo_kv_events_sent_total", _int(publisher, "events_sent"))
        out.add("aiokvo_kv_event_send_errors_total", _int(publisher, "send_errors"))
        out.add("aiokvo_kv_event_replays_total", _int(publisher, "replays_served"))
        out.add("aiokvo_kv_event_buffer_bytes", _int(publisher, "buffer_bytes"))
    return out.families()


# One mapping each way: the collector writes these fields under these names, and
# totals_from_text reads them back (the failure, usage and breaker families have labels
# or derived values of their own).
_TIER_SAMPLES: Mapping[str, str] = {
    "aiokvo_lookups_total": "lookups",
    "aiokvo_hit_blocks_total": "hit_blocks",
    "aiokvo_miss_blocks_total": "miss_blocks",
    "aiokvo_stored_blocks_total": "stored_blocks",
    "aiokvo_loaded_blocks_total": "loaded_blocks",
    "aiokvo_evicted_blocks_total": "evicted_blocks",
    "aiokvo_refused_stores_total": "stores_refused",
    "aiokvo_checksum_failures_total": "checksum_failures",
    "aiokvo_timeouts_total": "timeouts",
    "aiokvo_breaker_trips_total": "breaker_trips",
    "aiokvo_pool_capacity_blocks": "num_blocks",
    "aiokvo_pool_used_blocks": "used_blocks",
    "aiokvo_pool_pinned_blocks": "pinned_blocks",
    "aiokvo_pool_writing_blocks": "writing_blocks",
    "aiokvo_pool_capacity_bytes": "capacity_bytes",
    "aiokvo_pool_used_bytes": "used_bytes",
}
_TRANSFER_SAMPLES: Mapping[str, str] = {
    "aiokvo_transfers_total": "transfers",
    "aiokvo_transfer_failures_total": "failures",
    "aiokvo_transfer_bytes_total": "bytes",
    "aiokvo_transfer_copy_seconds_total": "seconds",
    "aiokvo_transfers_in_flight": "in_flight",
}


def _tier(out: _Builder, medium: str, t: TierTotals) -> None:
    for name, key in _TIER_SAMPLES.items():
        out.add(name, getattr(t, key), medium)
    out.add("aiokvo_failed_blocks_total", t.store_failed_blocks, medium, "store")
    out.add("aiokvo_failed_blocks_total", t.load_failed_blocks, medium, "load")
    out.add("aiokvo_pool_usage_ratio", t.usage, medium)
    if t.breaker_state is not None:
        states = dict.fromkeys((*_BREAKER_STATES, t.breaker_state))
        for state in states:
            out.add("aiokvo_breaker_state", float(state == t.breaker_state), medium, state)


_COMMON_TIER_FIELDS = frozenset({
    "medium", "lookups", "lookup_hits", "blocks_written", "blocks_read", "evictions",
    "write_failures", "read_failures", "checksum_failures", "timeouts", "capacity_blocks",
    "used_blocks", "capacity_bytes", "used_bytes", "failure_causes", "breaker",
})  # fmt: skip
"""Tier fields exported in the families every tier (the CPU pool too) shares."""


def _tier_fields(out: _Builder, stats: TierStatistics) -> None:
    """Every other numeric field of a tier's snapshot, as ``aiokvo_tier_<field>``
    (a counter, ``_total``, unless the snapshot lists it in ``GAUGES``), with the
    field's own doc as help: a counter added to a tier's statistics is exported
    with no edit here. Failures by cause go to ``aiokvo_tier_failed_blocks_total``."""
    kind = type(stats)
    docs = field_docs(kind)
    medium = stats.medium
    for f in fields(kind):
        name = f.name
        value = getattr(stats, name)
        if name in _COMMON_TIER_FIELDS or isinstance(value, bool):
            continue
        if not isinstance(value, int | float):
            continue
        gauge = name in kind.GAUGES
        metric = f"aiokvo_tier_{name}" if gauge else f"aiokvo_tier_{name}_total"
        out.add_dynamic("gauge" if gauge else "counter", metric, docs.get(name, name),
                        ("medium",), value, medium)  # fmt: skip
    out.add_dynamic("gauge", "aiokvo_tier_connected",
                    docs.get("connected", "connected"), ("medium",),
                    float(stats.connected), medium)  # fmt: skip
    for cause, count in sorted(stats.failure_causes.items()):
        out.add_dynamic("counter", "aiokvo_tier_failed_blocks_total",
                        "Blocks a tier transfer did not move, by the store's cause.",
                        ("medium", "cause"), count, medium, cause)  # fmt: skip
    out.add_dynamic("counter", "aiokvo_breaker_rejected_total",
                    "Operations the tier's circuit breaker turned away.",
                    ("medium",), stats.breaker.rejected, medium)  # fmt: skip


def _transfer(out: _Builder, direction: str, medium: str, way: TransferTotals) -> None:
    for name, key in _TRANSFER_SAMPLES.items():
        out.add(name, getattr(way, key), direction, medium)


def _parts(out: _Builder, stats: Any) -> None:
    """The Offloader's own counters and its parts' (what is not per tier)."""
    manager = getattr(stats, "manager", stats)
    if hasattr(stats, "loads") and hasattr(stats, "leases"):  # an OffloaderStatistics
        out.add("aiokvo_offloader_calls_total", stats.loads, "load_prefix")
        out.add("aiokvo_offloader_calls_total", stats.stores, "store")
        out.add("aiokvo_offloader_leases_total", stats.leases)
        out.add("aiokvo_offloader_active_leases", stats.active_leases)
        out.add("aiokvo_offloader_store_waits_total", stats.store_waits + stats.polled_waits)
        out.add("aiokvo_offloader_cancelled_waits_total", stats.cancelled_waits)
        out.add("aiokvo_offloader_waiters", stats.waiters)
        out.add("aiokvo_offloader_promotions_total",
                sum(t.reads for t in getattr(stats, "tiers", ())))  # the tiers' reads
        out.add("aiokvo_offloader_promotion_timeouts_total", _int(stats, "promotion_timeouts"))
        out.add("aiokvo_offloader_promotions_no_room_total", _int(stats, "promotions_no_room"))
        out.add("aiokvo_offloader_tier_writes_skipped_blocks_total",
                _int(stats, "tier_writes_skipped"))
        control = getattr(stats, "control", None)
        if control is not None:
            _control_fields(out, control)
    out.add("aiokvo_reuse_filtered_blocks_total", _int(manager, "reuse_filtered_blocks"))
    out.add("aiokvo_reuse_tracked_keys", _int(manager, "reuse_tracked_keys"))
    worker = getattr(stats, "worker", stats)
    out.add("aiokvo_submit_failures_total", _int(worker, "submit_failures"))
    out.add("aiokvo_dropped_results_total", _int(worker, "dropped_results"), "get_finished")
    poller = getattr(stats, "poller", None)
    if poller is not None:
        out.add("aiokvo_poller_pending", poller.pending)
        out.add("aiokvo_poller_threads", poller.active_threads)
        out.add("aiokvo_poller_callback_errors_total", poller.callback_errors)


_RETENTION_GAUGES = frozenset({"budget_blocks", "retained_blocks", "retentions"})


def _control_fields(out: _Builder, control: ControlStatistics) -> None:
    """The cache-control counters, each field as ``aiokvo_control_<field>_total`` and
    retention's as ``aiokvo_retention_<field>`` (gauges for what it holds now), with
    the fields' own docs as help: a field added there is exported with no edit here."""
    docs = field_docs(ControlStatistics)
    for f in fields(ControlStatistics):
        value = getattr(control, f.name)
        if isinstance(value, int) and not isinstance(value, bool):
            out.add_dynamic("counter", f"aiokvo_control_{f.name}_total",
                            docs.get(f.name, f.name), (), value)  # fmt: skip
    retention = control.retention
    if retention is None:
        return
    docs = field_docs(RetentionStatistics)
    for f in fields(RetentionStatistics):
        gauge = f.name in _RETENTION_GAUGES
        metric = f"aiokvo_retention_{f.name}" if gauge else f"aiokvo_retention_{f.name}_total"
        out.add_dynamic("gauge" if gauge else "counter", metric, docs.get(f.name, f.name),
                        (), getattr(retention, f.name))  # fmt: skip


def _int(obj: object, name: str) -> int | None:
    value = getattr(obj, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- serving --------------------------------------------------------------------------


class MetricsServer(AsyncResource):
    """An HTTP endpoint serving a registry (``/metrics``, or any path), on a thread.

    Made by :func:`start_metrics_server`. ``port`` is the port actually bound
    (pass 0 for an ephemeral one), ``url`` the address to scrape. ``aclose()``
    (``async with``) stops the server without blocking the loop, then closes
    the :class:`OffloadMetrics` it made; ``close()`` does the same
    synchronously (it waits up to half a second for the server thread).
    """

    def __init__(self, metrics: OffloadMetrics, server: Any, thread: threading.Thread,
                 *, owns_metrics: bool) -> None:
        self._metrics = metrics
        self._server = server
        self._thread = thread
        self._owns = owns_metrics
        self._closed = False
        host, port = server.server_address[:2]
        self.host: str = str(host)
        self.port: int = int(port)

    @property
    def metrics(self) -> OffloadMetrics:
        """The collector this server exports."""
        return self._metrics

    @property
    def url(self) -> str:
        """The scrape URL (``http://host:port/metrics``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def _stop_server(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def close(self) -> None:
        """Stop serving and close the metrics this server made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_server()
        finally:
            if self._owns:
                self._metrics.close()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.to_thread(self._stop_server)
        finally:
            if self._owns:
                await self._metrics.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"<MetricsServer {state} {self.url}>"


def start_metrics_server(
    source: Any,
    port: int,
    addr: str = "127.0.0.1",
    *,
    registry: CollectorRegistry | None = None,
    **options: Any,
) -> MetricsServer:
    """Serve ``source``'s metrics over HTTP on ``addr:port``; returns the running server.

    ``source`` is what :class:`OffloadMetrics` takes (an Offloader, ...),
    registered in ``registry`` (a new one of its own by default, so that two
    servers in one process never collide; pass prometheus-client's
    ``REGISTRY`` to serve the process's other metrics too), with ``options``
    passed on; or an existing :class:`OffloadMetrics`, whose registry is
    served as is. ``addr`` defaults to loopback: expose it on purpose.
    Use ``async with start_metrics_server(off, 9400):`` or close it.
    """
    port = check_int("port", port, minimum=0, maximum=65535)
    if not isinstance(addr, str) or not addr:
        raise ConfigError(f"addr must be a host name or address, got {addr!r}")
    if isinstance(source, OffloadMetrics):
        if registry is not None or options:
            raise ConfigError("pass registry and options to the OffloadMetrics, not here")
        metrics, owns = source, False
    else:
        metrics = OffloadMetrics(
            source, CollectorRegistry() if registry is None else registry, **options
        )
        owns = True
    try:
        server, thread = start_http_server(port, addr=addr, registry=metrics.registry)
    except BaseException:
        if owns:
            metrics.close()
        raise
    thread.name = f"aiokvo-metrics-http-{server.server_address[1]}"
    return MetricsServer(metrics, server, thread, owns_metrics=owns)


# -- reading an exposition back (the live view) ---------------------------------------

def totals_from_text(text: str, *, at: float | None = None) -> Totals:
    """:class:`~aiokvo.telemetry.stats.Totals` from a scrape of aiokvo's metrics.

    The inverse of the collector, for a process that only sees the endpoint
    (``python -m aiokvo.telemetry watch``). Series that differ only in other
    labels (constant labels, several processes behind one endpoint) are added up.
    """
    tiers: dict[str, dict[str, Any]] = {}
    ways: dict[tuple[str, str], dict[str, float]] = {}
    control: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            medium = labels.get("medium")
            if medium is None:
                if name.startswith(("aiokvo_control_", "aiokvo_retention_")):
                    key = name.removeprefix("aiokvo_").removeprefix("control_")
                    key = key.removesuffix("_total")
                    control[key] = control.get(key, 0.0) + value
                continue
            if name in _TIER_SAMPLES:
                fields = tiers.setdefault(medium, {})
                key = _TIER_SAMPLES[name]
                fields[key] = fields.get(key, 0) + round(value)
            elif name == "aiokvo_failed_blocks_total":
                fields = tiers.setdefault(medium, {})
                key = f"{labels.get('direction', 'store')}_failed_blocks"
                fields[key] = fields.get(key, 0) + round(value)
            elif name == "aiokvo_breaker_state":
                fields = tiers.setdefault(medium, {})
                if value >= 1:
                    fields["breaker_state"] = labels.get("state")
            elif name in _TRANSFER_SAMPLES and labels.get("direction") in ("load", "store"):
                way = ways.setdefault((labels["direction"], medium), {})
                key = _TRANSFER_SAMPLES[name]
                way[key] = way.get(key, 0.0) + value
    transfers: dict[tuple[Direction, str], TransferTotals] = {}
    for (direction, medium), way in ways.items():
        d: Direction = "load" if direction == "load" else "store"
        transfers[(d, medium)] = TransferTotals(
            direction=d,
            medium=medium,
            transfers=round(way.get("transfers", 0)),
            failures=round(way.get("failures", 0)),
            bytes=round(way.get("bytes", 0)),
            seconds=way.get("seconds", 0.0),
            in_flight=round(way.get("in_flight", 0)),
        )
    return Totals(
        at=time.monotonic() if at is None else at,
        tiers={m: TierTotals(medium=m, **f) for m, f in tiers.items()},
        transfers=transfers,
        control=control,
    )


# -- argument checks ------------------------------------------------------------------


def _check_tiers(tiers: Mapping[str, Any] | None) -> dict[str, Callable[[], object]]:
    if tiers is None:
        return {}
    if not isinstance(tiers, Mapping):
        raise ConfigError(f"tiers must map a medium to a statistics source, got {tiers!r}")
    out: dict[str, Callable[[], object]] = {}
    for name, source in tiers.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tiers keys must be medium names, got {name!r}")
        read = getattr(source, "statistics", source)
        if not callable(read):
            raise ConfigError(
                f"tiers[{name!r}] must have statistics() or be callable, got {source!r}"
            )
        out[name] = read
    return out


def _check_labels(labels: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if labels is None:
        return ()
    if not isinstance(labels, Mapping):
        raise ConfigError(f"labels must map label names to values, got {labels!r}")
    taken = {name for spec in METRICS for name in spec.labels} | {"le"}
    out = []
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL.match(name) or name.startswith("__"):
            raise ConfigError(f"label name {name!r} is not a valid Prometheus label name")
        if name in taken:
            raise ConfigError(f"label name {name!r} is one aiokvo's metrics use already")
        if not isinstance(value, str):
            raise ConfigError(f"label {name!r} must have a str value, got {value!r}")
        out.append((name, value))
    return tuple(out)


def _check_buckets(name: str, buckets: Sequence[float]) -> tuple[float, ...]:
    try:
        bounds = tuple(float(b) for b in buckets)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a sequence of numbers, got {buckets!r}") from None
    if not bounds or any(b != b or b == float("inf") for b in bounds) or list(bounds) != sorted(
        set(bounds)
    ):
        raise ConfigError(f"{name} must be finite, strictly increasing and not empty, "
                          f"got {buckets!r}")
    return bounds


def _check_seconds(name: str, value: object, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        minimum <= value <= 3600
    ):
        raise ConfigError(f"{name} must be {minimum}..3600 seconds, got {value!r}")
    return float(value)
