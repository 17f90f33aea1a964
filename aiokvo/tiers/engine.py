"""``StoreTier``: the one implementation of :class:`~aiokvo.tiers.base.Tier`.

Every tier is this shell around two small parts (DESIGN.md, "The tier
engine"): a :class:`~aiokvo.tiers.store.BlockStore` (blocking byte I/O) and
the :class:`~aiokvo.tiers.index.Index` it places blocks with. Everything
else is written once, here and in the pure :class:`~aiokvo.tiers.core.
TierCore` it drives:

* **binding**: the layout fingerprint (model, dtype, page geometry, rank:
  a tier never serves another layout's bytes), the pool's rows as the store
  sees them, the room the store asked for after each row, and the two
  :class:`~aiokvo.tiers.io.StoreHandler` routes (reads never queue behind
  writes);
* **opening**: the store's ``open`` on a thread; a store that connects
  (``reconnects``) may be unreachable, and then the tier starts
  disconnected and a background task connects when it can (with backoff),
  and runs the breaker's half-open trial as the store's own probe
  (``probes``); a store that sees other writers runs its ``maintenance``
  every ``maintenance_interval`` seconds;
* **lookups**: from the index, or, for a remote store, one ``exists`` call
  shared by the lookups of one loop turn, within ``lookup_timeout``;
* **transfers**: the gate, admission, tickets, deadlines, outcomes and
  counters of the core; housekeeping (removing bad blocks) queued on the
  write thread, after the writes before it;
* **closing**: bounded. Transfers get until their deadline once more;
  stuck ones are abandoned and counted, and the store is closed when they
  come back, so a dead disk or server never hangs shutdown.

The loop never blocks: every store call runs on the tier's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

from aiokvo.errors import ConfigError, TierUnavailableError
from aiokvo.handlers.routes import HandlerRoute
from aiokvo.keys import OffloadKey
from aiokvo.runtime.daemons import DaemonPool
from aiokvo.specs import CPULoadStoreSpec, TransferResult
from aiokvo.tiers.base import Tier, TierBinding, TierLoad, TierStatistics, TierStore
from aiokvo.tiers.core import TierCore
from aiokvo.tiers.fingerprint import LayoutFingerprint
from aiokvo.tiers.index import Index, RemoteIndex
from aiokvo.tiers.io import StoreHandler
from aiokvo.tiers.outcome import Outcome
from aiokvo.tiers.settings import TierSettings
from aiokvo.tiers.spec import TierSpec, spec_class
from aiokvo.tiers.store import BlockStore, PoolRows, StoreBinding

if TYPE_CHECKING:
    from aiokvo.config import OffloadConfig
    from aiokvo.layout import CanonicalKVCaches

__all__ = ["StoreTier"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(slots=True, eq=False)
class _LookupBatch:
    """Remote lookups of one loop turn, answered by one ``exists`` call."""

    future: asyncio.Future[list[int] | None]
    names: list[Any] = field(default_factory=list)
    timed_out: bool = False


class StoreTier(Tier):
    """A tier: ``store`` below the CPU pool, configured by ``settings``; see the module.

    ``clock`` is the breaker's and the indexes' clock (tests pass a fake one).
    """

    def __init__(
        self,
        store: BlockStore,
        settings: TierSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(settings, TierSettings):
            raise ConfigError(f"settings must be TierSettings, got {settings!r}")
        self.store = store
        self.settings = settings
        self.medium = store.medium
        self.io_timeout = settings.io_timeout
        self.max_write_blocks = settings.max_write_blocks or 0
        self._clock = clock
        self._core: TierCore | None = None
        self._rows: PoolRows | None = None
        self._fingerprint: LayoutFingerprint | None = None
        self._writer: StoreHandler | None = None
        self._reader: StoreHandler | None = None
        self._tickets: dict[TierSpec, object] = {}
        self._executor: DaemonPool | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake: asyncio.Event | None = None
        self._pending: _LookupBatch | None = None
        self._opening: asyncio.Future[None] | None = None
        self._first: asyncio.Task[bool] | None = None
        self._opened = self._closed = False

    # ------------------------------------------------------------- binding
    @property
    def fingerprint(self) -> LayoutFingerprint:
        """The layout fingerprint (after :meth:`bind`)."""
        if self._fingerprint is None:
            raise ConfigError(f"the {self.medium} tier is not bound to KV caches yet")
        return self._fingerprint

    @property
    def core(self) -> TierCore:
        """The pure core (after :meth:`bind`): read it, don't drive it."""
        if self._core is None:
            raise ConfigError(f"the {self.medium} tier is not bound to KV caches yet")
        return self._core

    @property
    def index(self) -> Index:
        """The store's index (after :meth:`bind`): read it, don't drive it."""
        return self.core.index

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has begun."""
        return self._closed

    def pool_row_tail_bytes(self, kv_caches: CanonicalKVCaches, config: OffloadConfig) -> int:
        return self.store.row_tail_bytes(kv_caches, config)

    def bind(self, binding: TierBinding) -> Sequence[HandlerRoute]:
        if self._fingerprint is not None:
            raise ConfigError(f"{self!r} is already bound; a tier serves one Offloader")
        settings = self.settings
        dtype = settings.dtype or binding.dtype or binding.kv_caches.dtype
        if dtype is None:
            raise ConfigError(
                f"the {self.medium} tier needs the KV dtype for its layout fingerprint (so "
                "that no engine of another dtype reads its blocks): build the caches with "
                "CanonicalKVCaches.from_engine(tensors), or give the tier dtype=..."
            )
        fingerprint = LayoutFingerprint.of(
            binding.kv_caches, binding.config, model_id=settings.model_id, dtype=dtype
        )
        rows = PoolRows(binding.cpu_tensors, fingerprint, row_tail_bytes=binding.row_tail_bytes)
        store = self.store
        index = store.bind(StoreBinding(
            fingerprint, rows, settings, binding.config.num_cpu_blocks, binding.events,
            self.medium,
        ))  # fmt: skip
        caps = store.capabilities
        self._core = TierCore(
            index, settings, spec_class=spec_class(self.medium), probes=caps.probes,
            connected=not caps.reconnects,
        )  # fmt: skip
        if not self.max_write_blocks:
            self.max_write_blocks = max(1, binding.config.num_cpu_blocks // 2)
        self._fingerprint, self._rows = fingerprint, rows
        common: dict[str, Any] = {
            "io_timeout": settings.io_timeout, "on_overdue": self._overdue,
            "on_abandon": self._abandoned,
        }  # fmt: skip
        self._writer = StoreHandler(store, rows, write=True, **common)
        self._reader = StoreHandler(store, rows, write=False, slots=settings.read_slots,
                                    **common)  # fmt: skip
        tier_spec = spec_class(self.medium)
        return [
            (CPULoadStoreSpec, tier_spec, self._writer),
            (tier_spec, CPULoadStoreSpec, self._reader),
        ]

    # ------------------------------------------------------------- opening
    async def open(self) -> None:
        """Open the store once (concurrent callers share it); see the module."""
        if self._core is None:
            raise ConfigError(f"bind the {self.medium} tier before opening it")
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)

    async def _open(self) -> None:
        self._opened = True
        self._executor = DaemonPool(2, f"aiokvo-{self.medium.lower()}-ctl")
        loop = asyncio.get_running_loop()
        caps = self.store.capabilities
        if caps.reconnects:
            # Connect in the background: the first call waits for it no longer than a
            # lookup may take (a slow or absent cluster must not hold up the pool).
            self._wake = asyncio.Event()
            first = self._first = loop.create_task(self._connect())
            self._tasks.append(loop.create_task(self._watch_connection(first)))
            await asyncio.wait([first], timeout=caps.lookup_timeout)
        else:
            self._adopt(await self._call(self.store.open))
        await self.maintain()
        if caps.maintenance_interval > 0:
            self._tasks.append(loop.create_task(self._maintain_every(caps.maintenance_interval)))

    async def first_connection(self) -> bool:
        """Wait until the first connection attempt has ended (a store that connects; it
        is bounded by ``connect_timeout``); whether the tier is connected."""
        first = self._first
        if first is not None and not first.done():
            await asyncio.wait([first])
        return self._core is not None and self._core.connected and not self._closed

    def _adopt(self, found: Any) -> None:
        removals = self.core.index.adopt(found)
        if removals:
            self._remove_later(removals)

    async def connect(self) -> bool:
        """Try to connect now (the tier also does so by itself); whether it is connected."""
        if not self._opened or self._closed:
            return False
        return await self._connect()

    async def _connect(self) -> bool:
        core = self.core
        if core.connected:
            return True
        caps = self.store.capabilities
        try:
            found = await asyncio.wait_for(
                asyncio.shield(self._call(self.store.open)), caps.connect_timeout
            )
        except (TierUnavailableError, TimeoutError, OSError) as exc:
            core.connect_failures += 1
            level = logging.WARNING if core.connect_failures == 1 else logging.DEBUG
            logger.log(level, "%s tier: not connected: %s", self.medium,
                       exc or "the connection attempt passed its deadline")  # fmt: skip
            return False
        if self._closed:
            return False
        core.connects += 1
        self._adopt(found)
        core.set_connected(True, self._clock())
        logger.info("%s tier: connected (%r)", self.medium, self)
        return True

    async def _watch_connection(self, first: asyncio.Task[bool]) -> None:
        """After the ``first`` attempt: reconnect while disconnected; run the breaker's
        trial while it is half-open."""
        core, wake = self.core, self._wake
        assert wake is not None
        try:
            await asyncio.shield(first)
        except asyncio.CancelledError:
            first.cancel()
            raise
        except Exception as exc:  # a bug in connecting: say so, and keep trying
            logger.error("%s tier: connecting failed: %r", self.medium, exc)
        settings = self.settings
        backoff = settings.reset_after
        poll = max(0.005, min(0.25, settings.reset_after / 4))
        while not self._closed:
            try:
                now = self._clock()
                if not core.connected:
                    if await self._connect():
                        backoff = settings.reset_after
                    else:
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, settings.max_reset_after)
                    continue
                if core.needs_probe(now) and core.breaker.acquire(now):
                    core.record_probe(await self._probe(), self._clock())
                    continue
                if core.usable(now):
                    wake.clear()
                    await wake.wait()
                else:
                    await asyncio.sleep(poll)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watcher must outlive any one failure
                logger.warning("%s tier: connection watcher: %r", self.medium, exc)
                await asyncio.sleep(poll)

    async def _probe(self) -> bool:
        try:
            return bool(await asyncio.wait_for(
                asyncio.shield(self._call(self.store.probe)),
                self.store.capabilities.lookup_timeout,
            ))  # fmt: skip
        except (TierUnavailableError, TimeoutError, RuntimeError, OSError):
            return False

    def _check_health(self) -> None:
        """Wake the connection watcher if the store may not be used now."""
        core, wake = self._core, self._wake
        if wake is not None and core is not None and not core.usable(self._clock()):
            wake.set()

    async def maintain(self) -> None:
        """Run the store's maintenance now (a disk tier indexes what others wrote)."""
        core = self._core
        if core is None or self._closed or not self._opened:
            return
        work = self.store.maintenance(core.index)
        if work is None:
            return
        call = self._call(work)
        try:
            apply = await asyncio.shield(call)
        except asyncio.CancelledError:  # the work goes on: apply it when it is done
            call.add_done_callback(partial(_apply_late, core.index))
            raise
        apply(core.index)  # also once closed: the store then releases what the work opened

    async def _maintain_every(self, interval: float) -> None:
        while not self._closed:
            await asyncio.sleep(interval)
            try:
                await self.maintain()
            except Exception as exc:  # a failed refresh must not end the tier
                logger.warning("%s tier: maintenance failed: %r", self.medium, exc)

    def _call(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """``fn()`` on a control thread (raises RuntimeError once the tier closed)."""
        executor = self._executor
        if executor is None or self._closed:
            raise RuntimeError(f"the {self.medium} tier is closed")
        future = asyncio.wrap_future(executor.submit(fn))
        future.add_done_callback(_retrieve)  # a caller cancelled at close stops waiting
        return future

    # ------------------------------------------------------------- lookups
    def lookup_nowait(self, keys: Sequence[OffloadKey]) -> int:
        """Leading ``keys`` the tier knows it holds (a remote store is not asked)."""
        core = self.core
        if self._closed or not self._opened:
            core.lookups += 1
            core.lookups_bypassed += 1
            return 0
        return core.lookup(keys, self._clock())

    def committed(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        if self._closed or not self._opened:
            return []
        index, now = self.core.index, self._clock()
        return [k for k in dict.fromkeys(keys) if index.lookup((k,), now)]

    async def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` the tier holds (a remote store is asked, once per
        loop turn for every lookup of that turn, within ``lookup_timeout``)."""
        if not self.store.capabilities.remote or self._closed or not self._opened:
            return self.lookup_nowait(keys)
        core = self.core
        asked = core.begin_lookup(keys, self._clock())
        if asked is None:
            return 0
        answers: list[int] | None = []
        if asked:
            index = cast(RemoteIndex, core.index)
            answers = await self._exists([index.place_of(k) for k in asked])
        found = core.finish_lookup(keys, asked, answers, self._clock())
        self._check_health()
        return found

    async def _exists(self, names: list[Any]) -> list[int] | None:
        loop = asyncio.get_running_loop()
        batch = self._pending
        if batch is None:
            batch = self._pending = _LookupBatch(loop.create_future())
            loop.call_soon(self._flush)
        start = len(batch.names)
        batch.names.extend(names)
        timeout = self.store.capabilities.lookup_timeout
        try:
            answers = await asyncio.wait_for(asyncio.shield(batch.future), timeout)
        except TimeoutError:
            self._lookup_overdue(batch)  # counted now, whichever timer fired first
            return None
        return None if answers is None else answers[start : start + len(names)]

    def _flush(self) -> None:
        batch, self._pending = self._pending, None
        if batch is None:
            return
        try:
            call = self._call(partial(self.store.exists, batch.names))
        except RuntimeError:
            batch.future.set_result(None)
            return
        loop = asyncio.get_running_loop()
        timer = loop.call_later(
            self.store.capabilities.lookup_timeout, self._lookup_overdue, batch
        )
        call.add_done_callback(partial(self._lookup_done, batch, timer))

    def _lookup_overdue(self, batch: _LookupBatch) -> None:
        if batch.future.done() or batch.timed_out:
            return
        batch.timed_out = True
        self.core.record_lookup_call(False, self._clock(), timed_out=True)
        self._check_health()

    def _lookup_done(
        self, batch: _LookupBatch, timer: asyncio.TimerHandle, call: asyncio.Future[list[int]]
    ) -> None:
        timer.cancel()
        answers: list[int] | None
        if call.cancelled() or call.exception() is not None:
            answers = None
        else:
            answers = list(call.result())
            if len(answers) != len(batch.names) or any(a not in (0, 1) for a in answers):
                answers = None
        if not batch.timed_out:
            self.core.record_lookup_call(answers is not None, self._clock())
            self._check_health()
        if not batch.future.done():
            batch.future.set_result(answers)

    # ---------------------------------------------------------------- reads
    def prepare_load(self, keys: Sequence[OffloadKey]) -> TierLoad | None:
        if self._closed:
            return None
        load = self.core.prepare_read(keys, self._clock())
        if load is not None:
            assert isinstance(load.spec, TierSpec)
            self._tickets[load.spec] = load.state
        return load

    def complete_load(self, load: TierLoad, result: TransferResult) -> list[OffloadKey]:
        spec = load.spec
        assert isinstance(spec, TierSpec)
        self._tickets.pop(spec, None)
        good = self.core.complete_read(
            load, error=result.error, now=self._clock(), nbytes=self._bytes_ok(spec),
            seconds=result.transfer_time or 0.0,
        )  # fmt: skip
        removals = self.core.index.take_removals()
        if removals:
            self._remove_later(removals)
        self._check_health()
        return good

    # --------------------------------------------------------------- writes
    def offer(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        if self._closed or not self._opened:
            return []
        return self.core.offer(keys, self._clock())

    def prepare_store(self, keys: Sequence[OffloadKey]) -> TierStore | None:
        if self._closed:
            return None
        store = self.core.prepare_write(keys, self._clock())
        if store is not None:
            assert isinstance(store.spec, TierSpec)
            self._tickets[store.spec] = store.state
        return store

    def complete_store(self, store: TierStore, result: TransferResult) -> None:
        spec = store.spec
        assert isinstance(spec, TierSpec)
        self._tickets.pop(spec, None)
        self.core.complete_write(
            store, error=result.error, now=self._clock(), nbytes=self._bytes_ok(spec),
            seconds=result.transfer_time or 0.0,
        )  # fmt: skip
        self._check_health()

    # --------------------------------------------------------- the rest
    def _bytes_ok(self, spec: TierSpec) -> int:
        rows = self._rows
        assert rows is not None
        if len(rows.payload) == 1:  # one group: no key needs looking at
            return rows.payload[0] * spec.outcomes.count(Outcome.OK)
        return sum(
            rows.payload_bytes(key)
            for key, status in zip(spec.keys, spec.outcomes.status, strict=True)
            if status is Outcome.OK
        )

    def _overdue(self, spec: TierSpec) -> None:
        ticket = self._tickets.get(spec)
        if ticket is not None and self._core is not None:
            self._core.note_timeout(ticket, self._clock())
            self._check_health()

    def _abandoned(self, n: int) -> None:
        if self._core is not None:
            self._core.abandoned += n

    def _remove_later(self, places: list[Any]) -> None:
        """Remove bad blocks on the write thread, after the writes queued now (a slot
        cleared must not race a write that reuses it)."""
        writer = self._writer
        if writer is not None and not writer.closed:
            writer.run_later(partial(self.store.remove, places))

    # ----------------------------------------------------------- reporting
    def statistics(self) -> TierStatistics:
        store = self.store
        kind = store.statistics_type
        extra = dict(store.statistics_extra())
        core = self._core
        if core is None:
            return kind(medium=self.medium, connected=False, **_fields_of(kind, extra))
        now = self._clock()
        index = core.index
        extra.update(index.statistics_extra(now))
        return kind(
            medium=self.medium,
            capacity_blocks=index.capacity_blocks,
            used_blocks=index.used_blocks,
            connected=core.connected and not self._closed,
            evictions=index.evictions,
            removals=index.removals,
            failure_causes=dict(core.causes),
            breaker=core.breaker.statistics(now),
            **core.counters(),
            **_fields_of(kind, extra),
        )

    # ------------------------------------------------------------- closing
    async def aclose(self) -> None:
        """Stop the background tasks, close the handlers (the Offloader closed them
        already, through its worker), then the store; bounded (see the module).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pending, self._pending = self._pending, None
        if pending is not None and not pending.future.done():
            pending.future.set_result(None)
        self.store.interrupt()  # a connection attempt in flight gives up now
        handlers = [h for h in (self._writer, self._reader) if h is not None]
        for handler in handlers:
            await handler.aclose()
        stuck = [d for h in handlers if h.abandoned for d in h.dispatchers]
        close = self._close_store_after(stuck)
        try:
            # The store gets the tier's deadline to close; past it, it closes alone.
            await asyncio.wait_for(asyncio.shield(close), self.io_timeout)
        except TimeoutError:
            logger.error("%s tier: the store did not close within %s s; left to close alone",
                         self.medium, self.io_timeout)  # fmt: skip
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown()
            if self._core is not None:
                self._core.connected = False

    def _close_store_after(self, stuck: list[Any]) -> asyncio.Future[None]:
        """Close the store on a daemon thread once the ``stuck`` dispatch threads have
        finished their jobs (their I/O may still use the store's files), and the control
        call running now (an open, a connection, a refresh) has returned: what it opens,
        the close closes."""
        loop = asyncio.get_running_loop()
        done: Future[None] = Future()
        control = self._executor

        def close() -> None:
            try:
                if control is not None:
                    control.shutdown(wait=True, cancel_futures=True)
                for dispatcher in stuck:
                    dispatcher.shutdown(wait=True)
                if self._opened:
                    self.store.close()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=close, name=f"aiokvo-{self.medium.lower()}-close",
                         daemon=True).start()  # fmt: skip
        return asyncio.wrap_future(done, loop=loop)

    def __repr__(self) -> str:
        where = getattr(self.store, "where", None) or self.medium
        return f"<{type(self).__name__} {where}>"


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a control call's outcome seen: its caller may have stopped waiting."""
    if not future.cancelled():
        future.exception()


def _fields_of(kind: type[TierStatistics], values: dict[str, Any]) -> dict[str, Any]:
    """The ``values`` that are fields of ``kind`` (an index's counters a store's
    statistics do not report are left out)."""
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = frozenset(f.name for f in fields(kind))
    return {k: v for k, v in values.items() if k in names}


_FIELDS: dict[type[TierStatistics], frozenset[str]] = {}


def _apply_late(index: Index, call: asyncio.Future[Any]) -> None:
    """Apply a maintenance whose caller was cancelled (a closing tier's periodic refresh):
    the store must still release what the work opened."""
    if call.cancelled() or call.exception() is not None:
        return
    try:
        call.result()(index)
    except Exception as exc:  # nobody awaits it any more
        logger.warning("maintenance finished after its caller left, and failed: %r", exc)
