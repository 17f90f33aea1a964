"""A live view of a running process's cache: ``python -m aiokvo.telemetry watch``.

Two feeds, either or both:

* :class:`MetricsFeed` scrapes a metrics endpoint
  (:func:`~aiokvo.telemetry.prometheus.start_metrics_server`) and reads it back
  with :func:`~aiokvo.telemetry.prometheus.totals_from_text`: hit rates,
  bytes each way, pool usage, evictions, per tier;
* :class:`EventFeed` subscribes to a KV-event publisher
  (:class:`~aiokvo.telemetry.kv_events.KVEventPublisher`, or vLLM's own) and,
  given its replay endpoint, first replays what it buffered, so the view
  starts from the blocks already cached; a gap in the sequence numbers
  triggers another replay. Events say what is stored and removed per medium,
  not hits or bytes.

Every ``interval`` the view computes rates (:func:`~aiokvo.telemetry.stats.rates`)
and draws them: a table redrawn in place with ``rich`` on a terminal, one
plain line per tier otherwise (logs, pipes, ``--plain``). ``rich`` comes with
the ``watch`` extra; without it the plain lines are printed on a terminal too.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TextIO

from aiokvo.errors import ConfigError
from aiokvo.telemetry.stats import (
    TierRates,
    TierTotals,
    Totals,
    format_control,
    format_lines,
    rates,
)

__all__ = ["EventFeed", "MetricsFeed", "merge_totals", "watch"]


class MetricsFeed:
    """Totals scraped from an aiokvo metrics endpoint (``http://host:port/metrics``)."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"url must be an http(s) URL, got {url!r}")
        from aiokvo.telemetry.prometheus import totals_from_text  # needs prometheus-client

        self.url = url
        self._timeout = timeout
        self._parse = totals_from_text

    def _get(self) -> str:
        with urllib.request.urlopen(self.url, timeout=self._timeout) as response:
            body: bytes = response.read()
        return body.decode()

    async def totals(self) -> Totals:
        """One scrape (on a thread: the view's loop keeps drawing)."""
        return self._parse(await asyncio.to_thread(self._get))

    async def aclose(self) -> None:
        return None


@dataclass(slots=True)
class _Medium:
    resident: set[Any]
    stored: int = 0
    removed: int = 0


class EventFeed:
    """Totals kept from a KV-event stream (vLLM's wire format, either encoding).

    ``endpoint`` is the publisher's PUB address to connect to, ``replay`` its
    ROUTER address (optional). Blocks are counted by hash per medium: stored,
    removed, and resident (stored and not removed since the view started, or
    since the oldest batch the replay still had).
    """

    def __init__(
        self, endpoint: str, *, replay: str | None = None, topic: str = "",
        replay_timeout: float = 5.0,
    ) -> None:
        for name, value in (("endpoint", endpoint), ("replay", replay)):
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise ConfigError(f"{name} must be a ZMQ endpoint like 'tcp://host:5557', "
                                  f"got {value!r}")
        import msgspec  # the kv-events extra
        import zmq.asyncio

        from aiokvo.telemetry.kv_wire import DEFAULT_MEDIA

        self._zmq = zmq
        self._decode = msgspec.msgpack.Decoder().decode
        self._names = {tuple(wire): name for name, wire in DEFAULT_MEDIA.items()}
        self.endpoint, self.replay = endpoint, replay
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._ctx = zmq.asyncio.Context()
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._media: dict[str, _Medium] = {}
        self._next_seq: int | None = None
        self._monitor: Any = None
        self._monitor_owner: Any = None
        self.url = endpoint  # how notes name this feed
        self.connected = False
        self.refused = 0  # connection attempts refused (nothing listens there)
        self.batches = 0
        self.replayed = 0
        self.gaps = 0

    async def start(self) -> None:
        """Subscribe, catch up from the replay socket, then follow the live stream."""
        zmq = self._zmq
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        # Whether the connection is ever made: a publisher given a host address
        # connects too, and two connecting sockets never meet (see totals()).
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._monitor = zmq.Socket.shadow(monitor.underlying)  # read without awaiting
        self._monitor_owner = monitor
        sub.connect(self.endpoint)  # before the replay: what comes meanwhile is kept
        if self.replay is not None:
            await self._replay_from(0)
        self._task = asyncio.create_task(self._follow(), name="aiokvo-watch-events")

    async def _replay_from(self, start: int) -> None:
        zmq = self._zmq
        assert self.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self._replay_timeout)
                if len(frames) < 4:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0:
                    return
                self.replayed += 1
                self._apply(seq, frames[-1])
        except TimeoutError:
            pass  # no replay socket answering: follow the live stream only
        finally:
            dealer.close(linger=0)

    async def _follow(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big")
            expected = self._next_seq
            if expected is not None and seq > expected and self.replay is not None:
                self.gaps += 1
                await self._replay_from(expected)  # fills the gap, then this batch again
            self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        if self._next_seq is not None and seq < self._next_seq:
            return  # seen already (a replay overlapping the live stream)
        self._next_seq = seq + 1
        self.batches += 1
        try:
            batch = self._decode(payload)
            events = batch[1]
        except Exception:  # not a KV-event batch: skip it
            return
        for event in events:
            self._event(event)

    def _event(self, event: Any) -> None:
        if isinstance(event, dict):
            kind = event.get("type")
            hashes, wire = event.get("block_hashes") or [], (
                event.get("medium"), event.get("locality"), event.get("ownership"))
        elif isinstance(event, list) and event:
            kind = event[0]
            hashes = event[1] if len(event) > 1 else []
            medium = event[6] if kind == "BlockStored" and len(event) > 6 else (
                event[2] if len(event) > 2 else None)
            wire = (medium, None, None)
        else:
            return
        if kind == "AllBlocksCleared":
            for state in self._media.values():
                state.removed += len(state.resident)
                state.resident.clear()
            return
        name = self._medium_name(wire)
        found = self._media.get(name)
        state = self._media[name] = _Medium(set()) if found is None else found
        if kind == "BlockStored":
            state.stored += len(hashes)
            state.resident.update(_hashable(h) for h in hashes)
        elif kind == "BlockRemoved":
            state.removed += len(hashes)
            state.resident.difference_update(_hashable(h) for h in hashes)

    def _medium_name(self, wire: tuple[Any, Any, Any]) -> str:
        known = self._names.get(wire)
        if known is not None:
            return known
        medium, _, ownership = wire
        if isinstance(ownership, str) and ownership:
            return ownership.upper()
        return str(medium or "?")

    def _watch_connection(self) -> None:
        """Read the SUB socket's connection events that came since the last look."""
        monitor = self._monitor
        if monitor is None:
            return
        zmq = self._zmq
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.refused += 1

    async def totals(self) -> Totals:
        self._watch_connection()
        if not self.connected and self.refused and not self.batches:
            raise OSError(
                f"nothing accepts connections there (refused {self.refused} times). A "
                "KVEventPublisher binds only for a wildcard host ('tcp://*:PORT'), port 0, "
                "ipc:// or inproc://; given a host address such as 'tcp://127.0.0.1:PORT' it "
                "connects (vLLM's rule; its statistics().pub_mode says 'connect'), and two "
                "connecting ends never meet: start it with 'tcp://*:PORT' or bind=True"
            )
        tiers = {
            name: TierTotals(medium=name, stored_blocks=s.stored, evicted_blocks=s.removed,
                             used_blocks=len(s.resident))
            for name, s in self._media.items()
        }
        return Totals(at=time.monotonic(), tiers=tiers)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            if self._monitor is not None:
                self._sub.disable_monitor()
                self._monitor_owner.close(linger=0)
            self._sub.close(linger=0)
        self._ctx.term()


def _hashable(block_hash: Any) -> Any:
    return bytes(block_hash) if isinstance(block_hash, bytearray | memoryview) else block_hash


def merge_totals(first: Totals, *others: Totals) -> Totals:
    """``first``'s tiers and transfers, with fields it lacks (None) taken from the others."""
    tiers = dict(first.tiers)
    transfers = dict(first.transfers)
    for other in others:
        for name, tier in other.tiers.items():
            mine = tiers.get(name)
            if mine is None:
                tiers[name] = tier
                continue
            missing = {
                f.name: getattr(tier, f.name)
                for f in fields(TierTotals)
                if getattr(mine, f.name) is None and getattr(tier, f.name) is not None
            }
            tiers[name] = replace(mine, **missing)
        for key, way in other.transfers.items():
            transfers.setdefault(key, way)
    control = dict(first.control)
    for other in others:
        for name, value in other.control.items():
            control.setdefault(name, value)
    return Totals(at=first.at, tiers=tiers, transfers=transfers, control=control)


# -- drawing ----------------------------------------------------------------------------


class _PlainView:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    def __enter__(self) -> _PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def draw(
        self, elapsed: float, tier_rates: Mapping[str, TierRates], notes: list[str],
        control: str | None = None,
    ) -> None:  # fmt: skip
        stamp = f"[{elapsed:7.1f}s]"
        lines = format_lines(tier_rates) or ([] if notes else ["(no tiers reported yet)"])
        if control is not None:
            lines.append(control)
        for line in lines:
            print(f"{stamp} {line}", file=self._out)
        for note in notes:
            print(f"{stamp} {note}", file=self._out)
        self._out.flush()


class _RichView:
    def __init__(self, console: Any, title: str) -> None:
        from rich.live import Live

        self._console = console
        self._title = title
        self._live = Live(console=console, auto_refresh=False, transient=False)

    def __enter__(self) -> _RichView:
        self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.stop()

    def draw(
        self, elapsed: float, tier_rates: Mapping[str, TierRates], notes: list[str],
        control: str | None = None,
    ) -> None:  # fmt: skip
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"{self._title}  ({elapsed:.0f} s)", title_justify="left")
        for column in ("tier", "hit", "hit (all)", "load GB/s", "store GB/s", "pool",
                       "evicted/s", "notes"):
            table.add_column(column, justify="left" if column in ("tier", "notes") else "right")
        for medium, r in tier_rates.items():
            t = r.totals
            pool = _num(t.used_blocks)
            if t.used_blocks is not None and t.num_blocks is not None:
                pool = f"{t.used_blocks}/{t.num_blocks}"
            if t.usage is not None:
                pool += f" ({t.usage:.0%})"
            extra = []
            if t.checksum_failures:
                extra.append(f"checksum failures {t.checksum_failures}")
            if t.timeouts:
                extra.append(f"timeouts {t.timeouts}")
            if t.breaker_state not in (None, "closed"):
                extra.append(f"breaker {t.breaker_state}")
            table.add_row(
                medium, _pct(r.hit_rate), _pct(t.hit_rate), f"{r.load_bps / 1e9:.2f}",
                f"{r.store_bps / 1e9:.2f}", pool,
                "-" if r.evictions_per_s is None else f"{r.evictions_per_s:.0f}",
                ", ".join(extra),
            )
        parts: list[Any] = [table]
        if control is not None:
            parts.append(Text(control))
        parts.extend(Text(note, style="yellow") for note in notes)
        self._live.update(Group(*parts), refresh=True)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


# -- the command ------------------------------------------------------------------------


async def watch(
    *,
    metrics: Sequence[str] = (),
    events: str | None = None,
    replay: str | None = None,
    topic: str = "",
    interval: float = 1.0,
    duration: float | None = None,
    plain: bool = False,
    out: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run the live view until ``duration`` seconds have passed (forever if None)."""
    if replay is not None and events is None:
        raise ConfigError("--replay needs --events")
    if not metrics and events is None:
        raise ConfigError("give a metrics URL (--metrics) or a KV-event endpoint (--events)")
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        raise ConfigError(f"interval must be a positive number of seconds, got {interval!r}")
    if duration is not None and (isinstance(duration, bool) or not duration > 0):
        raise ConfigError(f"duration must be a positive number of seconds, got {duration!r}")
    out = sys.stdout if out is None else out
    feeds: list[MetricsFeed | EventFeed] = [MetricsFeed(url) for url in metrics]
    event_feed = None
    if events is not None:
        event_feed = EventFeed(events, replay=replay, topic=topic)
        feeds.append(event_feed)
    title = "aiokvo  " + "  ".join([*metrics, *([events] if events else [])])
    view = _view(out, plain, title)
    start = clock()
    try:
        if event_feed is not None:
            await event_feed.start()
        previous = await _sample(feeds)  # the first interval's rates start here
        with view:
            while True:
                await asyncio.sleep(interval if duration is None else
                                    max(0.0, min(interval, start + duration - clock())))
                notes: list[str] = []
                totals = await _sample(feeds, notes)
                if totals is not None:
                    view.draw(clock() - start, rates(previous, totals), notes,
                              format_control(totals.control))
                    previous = totals
                elif notes:
                    view.draw(clock() - start, {}, notes)
                if duration is not None and clock() - start >= duration:
                    return 0
    finally:
        for feed in feeds:
            await feed.aclose()


async def _sample(
    feeds: Sequence[MetricsFeed | EventFeed], notes: list[str] | None = None
) -> Totals | None:
    """Every feed's totals merged (None if none answered); failures go to ``notes``."""
    samples = []
    for feed in feeds:
        try:
            samples.append(await feed.totals())
        except (OSError, ValueError) as exc:  # the process went away: keep trying
            if notes is not None:
                notes.append(f"{getattr(feed, 'url', '')}: {exc}")
    return merge_totals(*samples) if samples else None


def _view(out: TextIO, plain: bool, title: str) -> _PlainView | _RichView:
    if not plain:
        try:
            from rich.console import Console
        except ImportError:
            return _PlainView(out)
        console = Console(file=out)
        if console.is_terminal:
            return _RichView(console, title)
    return _PlainView(out)
