"""Bounded async streams of a manager's events.

A manager publishes each :class:`~aiokvo.specs.OffloadingEvent` synchronously,
at the moment it makes it, by calling :meth:`EventSubscription.push` on every
attached subscription. The manager must never wait for a reader, so each
subscription owns a bounded buffer and drops events when it is full. A reader
that lost events is told so in-band: a :class:`Lagged` marker sits in the
stream exactly where the gap is, the way tokio's broadcast channel reports
``Lagged(n)``. Reading follows anyio memory streams and trio channels:
``receive()`` / ``receive_nowait()``, ``async for``, ``async with``, ``aclose()``.

Threading: ``push`` is called on the thread that runs the reader's event loop
(the manager is driven from that loop), or before any reader waits, for
example before the loop starts. It never blocks, never raises on a full
buffer, and needs no running loop. It is not safe to call from another thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TypeAlias

from aiokvo._util import AsyncResource, check_choice, check_int
from aiokvo.errors import SubscriptionClosed
from aiokvo.manager.sink import EventSink, OverflowPolicy
from aiokvo.specs import OffloadingEvent

__all__ = ["EventSubscription", "Lagged", "SubscriptionItem", "SubscriptionStatistics"]

_OVERFLOW_POLICIES: tuple[OverflowPolicy, ...] = ("drop_oldest", "drop_newest")


@dataclass(frozen=True, slots=True)
class Lagged:
    """``missed`` events were dropped at this point because the reader fell behind.

    Anything that mirrors the manager's state from the stream (for example a
    set of ready keys) is stale after a ``Lagged`` and should resynchronise.
    """

    missed: int


SubscriptionItem: TypeAlias = OffloadingEvent | Lagged
"""What a subscription yields: an event, or a marker for a gap before the next one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionStatistics:
    """One subscription now, and the events it lost over its life."""

    maxsize: int
    """Most events buffered at once."""
    overflow: OverflowPolicy
    """Which event is dropped when the buffer is full: ``"drop_oldest"`` or ``"drop_newest"``."""
    queued: int = 0
    """Events buffered now (``Lagged`` markers not counted)."""
    dropped: int = 0
    """Events lost to ``overflow`` over the subscription's life."""
    closed: bool = False
    """``close()`` ran (buffered events may still be readable)."""


class _Gap:
    """A mutable in-buffer gap, so repeated drops cost no allocation; read as Lagged."""

    __slots__ = ("missed",)

    def __init__(self, missed: int) -> None:
        self.missed = missed


class EventSubscription(AsyncResource):
    """One reader's bounded, in-order view of a manager's events.

    Created by :meth:`OffloadingManager.subscribe`, which attaches it to the
    manager's sink. At most ``maxsize`` events are buffered; when the buffer
    is full ``overflow`` decides which event is dropped:

    * ``"drop_oldest"`` drops the oldest buffered event, so the reader always
      sees the most recent history; the gap (and its ``Lagged``) is at the
      front of the buffer.
    * ``"drop_newest"`` drops the incoming event, so the reader sees the
      oldest history intact; the gap is at the back, and later events that
      fit after the reader catches up follow the ``Lagged`` marker.

    Consecutive drops at the same place merge into one ``Lagged``. Markers do
    not count against ``maxsize``. ``dropped`` counts every dropped event.

    The manager holds it weakly: one that nobody references any more (its
    reader returned from ``async for`` without closing it) detaches itself
    when it is collected, so an abandoned subscription costs the manager
    nothing.
    """

    __slots__ = (
        "__weakref__",  # the manager's sink holds subscriptions weakly
        "_buffer",
        "_closed",
        "_dropped",
        "_head_missed",
        "_maxsize",
        "_overflow",
        "_queued",
        "_sink",
        "_waiters",
    )

    def __init__(
        self,
        sink: EventSink,
        *,
        maxsize: int = 1024,
        overflow: OverflowPolicy = "drop_oldest",
    ) -> None:
        maxsize = check_int("maxsize", maxsize, minimum=1)
        overflow = check_choice("overflow", overflow, _OVERFLOW_POLICIES)
        self._sink = sink
        self._maxsize = maxsize
        self._overflow: OverflowPolicy = overflow
        # drop_oldest keeps only events in _buffer and counts its one gap (always
        # before the head) in _head_missed; drop_newest keeps _Gap entries in place.
        self._buffer: deque[OffloadingEvent | _Gap] = deque()
        self._head_missed = 0
        self._queued = 0  # events in _buffer; gaps are not counted
        self._dropped = 0
        self._closed = False
        self._waiters: deque[asyncio.Future[None]] = deque()
        sink.attach(self)

    # -- producer side (called by the manager's EventSink) -------------------

    def push(self, event: OffloadingEvent) -> None:
        """Buffer ``event`` for the reader; drop one event if the buffer is full.

        Never blocks and never raises for a full buffer. Ignored once closed.
        """
        if self._closed:
            return
        if self._queued < self._maxsize:
            self._buffer.append(event)
            self._queued += 1
        elif self._overflow == "drop_oldest":
            self._drop_oldest_then_append(event)
        else:
            self._drop_newest()
        if self._waiters:
            self._wake_one()

    def _drop_oldest_then_append(self, event: OffloadingEvent) -> None:
        self._buffer.popleft()  # full, and under drop_oldest it holds only events
        self._buffer.append(event)
        self._head_missed += 1
        self._dropped += 1

    def _drop_newest(self) -> None:
        tail = self._buffer[-1]
        if isinstance(tail, _Gap):
            tail.missed += 1
        else:
            self._buffer.append(_Gap(1))
        self._dropped += 1

    # -- consumer side --------------------------------------------------------

    def receive_nowait(self) -> SubscriptionItem:
        """The next item, without waiting.

        Raises :class:`asyncio.QueueEmpty` when nothing is buffered, and
        :class:`~aiokvo.errors.SubscriptionClosed` once closed and drained.
        """
        if self._head_missed:
            missed, self._head_missed = self._head_missed, 0
            return Lagged(missed)
        if self._buffer:
            item = self._buffer.popleft()
            if isinstance(item, _Gap):
                return Lagged(item.missed)
            self._queued -= 1
            return item
        if self._closed:
            raise SubscriptionClosed("the event subscription is closed and drained")
        raise asyncio.QueueEmpty

    def drain_nowait(self) -> list[SubscriptionItem]:
        """Everything buffered now, in order (empty when nothing is); never raises."""
        items: list[SubscriptionItem] = []
        if self._head_missed:
            items.append(Lagged(self._head_missed))
            self._head_missed = 0
        items.extend(Lagged(i.missed) if isinstance(i, _Gap) else i for i in self._buffer)
        self._buffer.clear()
        self._queued = 0
        return items

    async def receive(self) -> SubscriptionItem:
        """Wait for the next item.

        Raises :class:`~aiokvo.errors.SubscriptionClosed` once the
        subscription is closed and everything buffered before that was read.
        """
        while not self._buffer:  # a head gap implies buffered events behind it
            if self._closed:
                raise SubscriptionClosed("the event subscription is closed and drained")
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                # A wake-up meant for us must not be lost to another reader.
                if self._buffer and not waiter.cancelled():
                    self._wake_one()
                raise
        return self.receive_nowait()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> SubscriptionItem:
        try:
            return await self.receive()
        except SubscriptionClosed:
            raise StopAsyncIteration from None

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Detach from the manager; readers finish what is buffered, then stop.

        Idempotent, synchronous, and safe to call from the manager's
        ``shutdown()`` while a reader is waiting.
        """
        if self._closed:
            return
        self._closed = True
        self._sink.detach(self)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def aclose(self) -> None:
        """Async form of :meth:`close`, for symmetry with other resources."""
        self.close()

    # -- introspection ---------------------------------------------------------

    @property
    def maxsize(self) -> int:
        """Most events buffered at once."""
        return self._maxsize

    @property
    def overflow(self) -> OverflowPolicy:
        """Which event is dropped when the buffer is full."""
        return self._overflow

    @property
    def dropped(self) -> int:
        """Events dropped over this subscription's life."""
        return self._dropped

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (buffered items may still be readable)."""
        return self._closed

    def qsize(self) -> int:
        """Events buffered now (``Lagged`` markers not counted)."""
        return self._queued

    def statistics(self) -> SubscriptionStatistics:
        """A snapshot of this subscription (see :class:`SubscriptionStatistics`)."""
        return SubscriptionStatistics(
            maxsize=self._maxsize,
            overflow=self._overflow,
            queued=self._queued,
            dropped=self._dropped,
            closed=self._closed,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<EventSubscription {state} queued={self._queued}/{self._maxsize} "
            f"overflow={self._overflow!r} dropped={self._dropped}>"
        )
