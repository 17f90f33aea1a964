"""The event poller: turns completion sources into loop callbacks and futures.

There is exactly one poller per running event loop. Backends hand it a
:class:`~aiokvo.runtime.sources.CompletionSource` together with a *lane*
(one per direction or stream). Completions within a lane happen in order,
so only the oldest pending source of each lane is ever checked.

Three ways to wait, chosen per poller and overridable per lane:

``spin``
    Poll on every loop iteration (a ``call_soon`` chain). Lowest latency,
    one core busy while anything is pending.
``adaptive``
    Spin for ``spin_budget`` seconds after each new submission or
    completion, then re-check every millisecond (asyncio timers below 1 ms
    round away, so there is no finer step).
``thread``
    One waiter thread per lane blocks in ``source.synchronize()`` and wakes
    the loop with ``call_soon_threadsafe``. No CPU while waiting; costs one
    thread hop per batch of completions. A source completed by one of our
    own Python threads may offer ``notify_when_done(wake)`` (see
    :class:`NotifyingSource`); then no waiter thread is needed: the
    completing thread wakes the loop itself. Device sources must not do
    this from a driver callback (``cudaLaunchHostFunc``). While a lane has
    work, the loop also polls its head every millisecond: a loop busy
    running Python can starve the waiter or completing thread of the GIL
    for seconds, and this bounds delivery at about 1 ms (docs/async.md).

In every mode, a pending head that is an
:class:`~aiokvo.runtime.sources.AssistableSource` is asked to ``assist()``
when polled from the loop: work its Python thread has not started in time
(starved of the GIL) is then done on the loop thread, in order.

With nothing pending the poller schedules no timers and its threads sleep
on a condition (exiting after ``idle_thread_timeout``), so it uses no CPU.

Closing refuses new sources at once but keeps watching those already handed
over, and reports each one only when it has really completed: a copy that is
still writing must not be reported as finished (failed or not), or its caller
would free blocks the copy is still writing to.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, TypeAlias, get_args, runtime_checkable

from aiokvo._util import check_choice
from aiokvo.errors import ConfigError, PollerClosedError
from aiokvo.runtime.lanes import (
    CompletionCallback,
    Entry,
    LaneWaiter,
    NotifiedLane,
    assist,
)
from aiokvo.runtime.sources import CompletionSource, HostEvent

__all__ = [
    "DEFAULT_POLLER_MODE",
    "POLLER_MODE_ENV",
    "CompletionCallback",
    "EventPoller",
    "NotifyingSource",
    "PollerMode",
    "PollerStatistics",
    "resolve_poller_mode",
]

PollerMode: TypeAlias = Literal["spin", "adaptive", "thread"]

DEFAULT_POLLER_MODE: PollerMode = "thread"
"""Chosen from ``benchmarks/bench_async.py``; see ``docs/async.md``."""

_FALLBACK_POLL = 0.001
"""Seconds between the loop's own polls of ``thread``-mode lanes while sources
are pending: the bound on delivery when the thread that waits on or completes
a source is starved of the GIL by a busy loop."""

POLLER_MODE_ENV = "AIOKVO_POLLER_MODE"
"""Environment variable that overrides the default mode of new pollers."""


@runtime_checkable
class NotifyingSource(CompletionSource, Protocol):
    """A completion source that can say when it is done, so no thread must wait on it.

    ``notify_when_done(wake)`` calls ``wake()`` once, from any thread, when
    the source completes (or at once if it already has). ``wake`` is cheap,
    thread-safe and never blocks. Only for sources completed by ordinary
    Python threads (like the host backend's); never from a CUDA host function.
    """

    def notify_when_done(self, wake: Callable[[], None]) -> None: ...


_MODES: tuple[PollerMode, ...] = get_args(PollerMode)
_BACKOFF_STEP = 0.001  # asyncio cannot sleep for less than about a millisecond



@dataclass(frozen=True, slots=True, kw_only=True)
class PollerStatistics:
    """One poller's state now and its counters since it was made.

    Pending sources sit in the lanes counted by ``polled_lanes``,
    ``waiter_lanes`` and ``notified_lanes``.
    """

    mode: PollerMode
    """How the poller waits by default: ``"spin"``, ``"adaptive"`` or ``"thread"``."""
    closed: bool = False
    """``close()`` was called: new sources are refused, those already watched still reported."""
    pending: int = 0
    """Sources watched and not yet reported."""
    polled_lanes: int = 0
    """Lanes the loop polls itself (``spin`` and ``adaptive``)."""
    waiter_lanes: int = 0
    """``thread``-mode lanes, each with one waiter thread."""
    notified_lanes: int = 0
    """Lanes whose sources wake the loop themselves (no waiter thread)."""
    active_threads: int = 0
    """Waiter threads alive now."""
    fallback_armed: bool = False
    """The loop's 1 ms safety poll of ``thread``-mode lanes is scheduled (only while
    something is pending there)."""
    delivered: int = 0
    """Completions reported to their callbacks."""
    callback_errors: int = 0
    """Delivered callbacks that raised (each went to the loop's exception handler)."""
    fallback_polls: int = 0
    """Safety polls of ``thread``-mode lanes that ran."""
    dropped_on_stop: int = 0
    """Callbacks never run because the loop closed (or was collected) while their
    sources were pending; closing the poller itself drops none."""


def _done(source: CompletionSource) -> bool:
    try:
        return source.query()
    except BaseException:
        return True  # failed: done


def resolve_poller_mode(mode: str | None = None) -> PollerMode:
    """Return ``mode`` if given, else ``$AIOKVO_POLLER_MODE``, else the default."""
    origin = "mode"
    if mode is None:
        mode = os.environ.get(POLLER_MODE_ENV) or None
        origin = POLLER_MODE_ENV
    if mode is None:
        return DEFAULT_POLLER_MODE
    return check_choice(origin, mode, _MODES)


def _report_callback_error(loop: asyncio.AbstractEventLoop, error: BaseException) -> None:
    loop.call_exception_handler(
        {"message": "aiokvo poller: completion callback raised", "exception": error}
    )


class EventPoller:
    """Watches completion sources for one event loop; see the module docstring.

    Use :meth:`current` or :meth:`for_loop` rather than the constructor,
    unless you want to configure the loop's poller before anything else
    creates it. All methods except :meth:`close` must be called on the
    loop's thread.
    """

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventPoller]] = (
        weakref.WeakKeyDictionary()
    )
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        mode: PollerMode | None = None,
        spin_budget: float = 100e-6,
        idle_thread_timeout: float = 5.0,
    ) -> None:
        if loop is None:
            loop = asyncio.get_running_loop()
        if loop.is_closed():
            raise PollerClosedError(f"cannot watch a closed event loop {loop!r}")
        if spin_budget < 0:
            raise ConfigError(f"spin_budget must be >= 0 seconds, got {spin_budget!r}")
        if idle_thread_timeout <= 0:
            raise ConfigError(
                f"idle_thread_timeout must be > 0 seconds, got {idle_thread_timeout!r}"
            )
        self._mode = resolve_poller_mode(mode)
        self.spin_budget = float(spin_budget)
        self.idle_thread_timeout = float(idle_thread_timeout)
        self._loop_ref = weakref.ref(loop)
        self._closed = False  # refuses new sources; those already watched are still reported
        self._stopped = False  # the loop is gone: nothing can be reported any more
        # Polled lanes (spin and adaptive), keyed by (mode, lane).
        self._lanes: dict[tuple[str, Hashable], deque[Entry]] = {}
        self._spin_lanes = 0
        self._tick_handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self._tick_is_timer = False
        self._spin_until = 0.0
        self._waiters: dict[Hashable, LaneWaiter] = {}
        self._fallback_handle: asyncio.TimerHandle | None = None
        self._notified: dict[Hashable, NotifiedLane] = {}
        self._delivered = 0
        self._callback_errors = 0
        self._fallback_polls = 0
        self._dropped_on_stop = 0
        with EventPoller._registry_lock:
            existing = EventPoller._by_loop.get(loop)
            if existing is not None and not existing._closed:
                raise ConfigError(f"loop {loop!r} already has an EventPoller")
            EventPoller._by_loop[loop] = self
        # The registry is weak-keyed, so a collected loop stops its poller.
        weakref.finalize(loop, self._stop)

    # ------------------------------------------------------------------ lookup
    @classmethod
    def current(cls) -> EventPoller:
        """The poller of the running loop, created on first use."""
        return cls.for_loop(asyncio.get_running_loop())

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> EventPoller:
        """The poller of ``loop``, created with the defaults on first use."""
        poller = cls._by_loop.get(loop)
        if poller is None or poller._closed:
            try:
                poller = cls(loop)
            except ConfigError:
                # Another thread won the race to create it, or the configuration
                # is bad (``$AIOKVO_POLLER_MODE``): then there is none to return.
                existing = cls.existing(loop)
                if existing is None:
                    raise
                poller = existing
        return poller

    @classmethod
    def existing(cls, loop: asyncio.AbstractEventLoop) -> EventPoller | None:
        """The live poller of ``loop`` if one was created, without creating one."""
        poller = cls._by_loop.get(loop)
        return None if poller is None or poller._closed else poller

    # -------------------------------------------------------------- properties
    @property
    def mode(self) -> PollerMode:
        """The mode used for lanes that do not ask for another."""
        return self._mode

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """Sources not yet reported (a snapshot; for tests and diagnostics)."""
        polled = sum(len(q) for q in self._lanes.values())
        notified = sum(len(n.queue) for n in self._notified.values())
        return polled + notified + sum(len(w._queue) for w in self._waiters.values())

    @property
    def active_threads(self) -> int:
        """Waiter threads currently alive."""
        return sum(1 for w in self._waiters.values() if w._alive)

    def statistics(self) -> PollerStatistics:
        """A snapshot of this poller (see :class:`PollerStatistics`)."""
        return PollerStatistics(
            mode=self._mode,
            closed=self._closed,
            pending=self.pending,
            polled_lanes=len(self._lanes),
            waiter_lanes=len(self._waiters),
            notified_lanes=len(self._notified),
            active_threads=self.active_threads,
            fallback_armed=self._fallback_handle is not None,
            delivered=self._delivered,
            callback_errors=self._callback_errors,
            fallback_polls=self._fallback_polls,
            dropped_on_stop=self._dropped_on_stop,
        )

    # ---------------------------------------------------------------- watching
    def watch(
        self, lane: Hashable, source: CompletionSource, *, mode: PollerMode | None = None
    ) -> asyncio.Future[None]:
        """A future that resolves when ``source`` completes, or fails with its error.

        Cancelling the future stops nobody from waiting on the source; the
        lane still waits for it before looking at later sources.
        """
        loop = self._require_loop()
        future: asyncio.Future[None] = loop.create_future()
        self.add_callback(lane, source, lambda error: _settle(future, error), mode=mode)
        return future

    def add_callback(
        self,
        lane: Hashable,
        source: CompletionSource,
        callback: CompletionCallback,
        *,
        mode: PollerMode | None = None,
    ) -> None:
        """Call ``callback(error_or_None)`` on the loop thread once ``source`` completes.

        The cheaper form of :meth:`watch`, used by handlers: no future per
        source. Callbacks of one lane run in the order they were added.
        """
        loop = self._require_loop()
        lane_mode = self._mode if mode is None else mode
        if lane_mode == "thread":
            notify = getattr(source, "notify_when_done", None)
            if notify is not None:
                notified = self._notified.get(lane)
                if notified is None:
                    notified = self._notified[lane] = NotifiedLane(self, lane)
                notified.queue.append((source, callback))
                if len(notified.queue) == 1 and isinstance(source, HostEvent) and _done(source):
                    # A host copy already done (made inline), first in its lane:
                    # drained from the loop without a wake-up through its self-pipe.
                    # (Device sources keep their notify: it is how they learn that
                    # nobody waits on them any more.)
                    if not notified.wake_pending:
                        notified.wake_pending = True
                        loop.call_soon(notified.drain)
                    return
                notify(notified.wake)
                if self._fallback_handle is None and notified.queue:
                    self._fallback_handle = loop.call_later(_FALLBACK_POLL, self._fallback_poll)
                return
            waiter = self._waiter_for(lane)
            if waiter.is_empty():
                # Already finished (an inline or empty copy): skip the thread hop.
                try:
                    done, error = source.query(), None
                except BaseException as exc:
                    done, error = True, exc
                if done:
                    loop.call_soon(self._run_batch, [(callback, error)])
                    return
            waiter.push((source, callback))
            if self._fallback_handle is None:
                self._fallback_handle = loop.call_later(_FALLBACK_POLL, self._fallback_poll)
            return
        lane_mode = check_choice("mode", lane_mode, _MODES)
        key = (lane_mode, lane)
        queue = self._lanes.get(key)
        if queue is None:
            queue = self._lanes[key] = deque()
            if lane_mode == "spin":
                self._spin_lanes += 1
        queue.append((source, callback))
        self._spin_until = time.perf_counter() + self.spin_budget
        if self._tick_handle is None:
            self._tick_handle = loop.call_soon(self._tick)
            self._tick_is_timer = False
        elif self._tick_is_timer:  # new work: spin again instead of sleeping
            self._tick_handle.cancel()
            self._tick_handle = loop.call_soon(self._tick)
            self._tick_is_timer = False

    # ----------------------------------------------------------------- closing
    def close(self) -> None:
        """Refuse new sources; report the ones already watched as they complete.

        Idempotent and non-blocking. While the loop runs, every source already
        handed over is still waited for and its callback still runs, with the
        source's own outcome, once it has really completed (never earlier:
        its caller may free the blocks a copy writes to); waiter threads exit
        as their lanes empty. New sources raise :class:`PollerClosedError`, and
        :meth:`for_loop` makes a fresh poller for the loop. Once the loop is
        closed (this may then be called from any thread), nothing more is
        reported and the threads are let go.
        """
        if self._closed:
            return
        self._closed = True
        loop = self._loop_ref()
        with EventPoller._registry_lock:
            if loop is not None and EventPoller._by_loop.get(loop) is self:
                del EventPoller._by_loop[loop]
        if loop is None or loop.is_closed():
            self._stop()
            return
        for lane, waiter in list(self._waiters.items()):
            if waiter.finish():  # idle: its thread exits now, nothing to wait for
                del self._waiters[lane]

    # --------------------------------------------------------------- internals
    def _require_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop_ref()
        if self._closed or loop is None or loop.is_closed():
            raise PollerClosedError("the event poller is closed")
        return loop

    def _stop(self) -> None:
        """The loop is gone (closed or collected): drop everything pending and let
        the threads go. Its handles are not cancelled: a closed loop runs none of
        them, and this may run on whatever thread collected the loop."""
        self._closed = self._stopped = True
        self._tick_handle = self._fallback_handle = None
        dropped = sum(len(queue) for queue in self._lanes.values())
        self._lanes.clear()
        self._spin_lanes = 0
        for notified in self._notified.values():
            dropped += len(notified.queue)
            notified.queue.clear()
        self._notified.clear()
        for waiter in list(self._waiters.values()):
            dropped += len(waiter.close())
        self._waiters.clear()
        self._dropped_on_stop += dropped

    def _fallback_poll(self) -> None:
        """Poll the heads of waiter lanes from the loop (1 ms timer while any is pending)."""
        self._fallback_handle = None
        loop = self._loop_ref()
        if self._stopped or loop is None or loop.is_closed():
            return
        self._fallback_polls += 1
        pending = False
        for waiter in list(self._waiters.values()):
            pending = waiter.poll_from_loop(loop) or pending
        for notified in list(self._notified.values()):
            pending = notified.poll_from_loop() or pending
        if pending:
            self._fallback_handle = loop.call_later(_FALLBACK_POLL, self._fallback_poll)

    def _waiter_for(self, lane: Hashable) -> LaneWaiter:
        waiter = self._waiters.get(lane)
        if waiter is None:
            waiter = self._waiters[lane] = LaneWaiter(self, f"aiokvo-waiter-{lane!r}")
        return waiter

    def _call_threadsafe(self, function: Callable[[], None]) -> bool:
        """Schedule ``function`` on the loop from any thread; False if the loop is gone."""
        loop = self._loop_ref()
        if loop is None or self._stopped:
            return False
        try:
            loop.call_soon_threadsafe(function)
        except RuntimeError:  # the loop closed under us
            return False
        return True

    def _invoke(self, callback: CompletionCallback, error: BaseException | None) -> None:
        self._delivered += 1
        try:
            callback(error)
        except Exception as exc:
            self._callback_errors += 1
            loop = self._loop_ref()
            if loop is not None:
                _report_callback_error(loop, exc)

    def _forget_notified(self, notified: NotifiedLane) -> None:
        if self._notified.get(notified.lane) is notified:
            del self._notified[notified.lane]

    def _deliver_threadsafe(
        self, batch: list[tuple[CompletionCallback, BaseException | None]]
    ) -> bool:
        """Hand completions to the loop from a waiter thread; False if it is gone."""
        loop = self._loop_ref()
        if loop is None or self._stopped:
            return False
        try:
            loop.call_soon_threadsafe(self._run_batch, batch)
        except RuntimeError:  # the loop closed under us
            return False
        return True

    def _run_batch(self, batch: list[tuple[CompletionCallback, BaseException | None]]) -> None:
        self._delivered += len(batch)
        for callback, error in batch:
            try:
                callback(error)
            except Exception as exc:
                self._callback_errors += 1
                loop = self._loop_ref()
                if loop is not None:
                    _report_callback_error(loop, exc)

    def _poll_lanes(self) -> bool:
        """Report every finished head of every polled lane; True if any finished."""
        progressed = False
        emptied: list[tuple[str, Hashable]] = []
        for key, queue in self._lanes.items():
            while queue:
                source, callback = queue[0]
                error: BaseException | None = None
                try:
                    if not source.query() and not (assist(source) and source.query()):
                        break
                except BaseException as exc:
                    error = exc
                queue.popleft()
                progressed = True
                self._delivered += 1
                try:
                    callback(error)
                except Exception as exc:
                    self._callback_errors += 1
                    loop = self._loop_ref()
                    if loop is not None:
                        _report_callback_error(loop, exc)
            if not queue:
                emptied.append(key)
        for key in emptied:
            # A callback may have re-filled the lane; only drop empty ones.
            left = self._lanes.get(key)
            if left is not None and not left:
                del self._lanes[key]
                if key[0] == "spin":
                    self._spin_lanes -= 1
        return progressed

    def _tick(self) -> None:
        self._tick_handle = None
        if self._stopped:
            return
        progressed = self._poll_lanes()
        if not self._lanes or self._tick_handle is not None:
            return  # idle (no timers), or a callback already re-armed us
        loop = self._loop_ref()
        if loop is None or loop.is_closed():
            return
        now = time.perf_counter()
        if progressed:
            self._spin_until = now + self.spin_budget
        if self._spin_lanes or now < self._spin_until:
            self._tick_handle = loop.call_soon(self._tick)
            self._tick_is_timer = False
        else:
            self._tick_handle = loop.call_later(_BACKOFF_STEP, self._tick)
            self._tick_is_timer = True


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
