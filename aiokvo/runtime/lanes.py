"""The poller's lanes: how completions of one FIFO lane reach the loop.

A *lane* is one direction or stream of a backend; its sources complete in
order, so only its oldest pending source is ever checked. Two kinds live
here, both owned by an :class:`~aiokvo.runtime.poller.EventPoller`:

* :class:`LaneWaiter` -- one thread that blocks in ``synchronize()`` on each
  source in turn and hands finished batches to the loop (``thread`` mode);
* :class:`NotifiedLane` -- sources that wake the loop themselves
  (``notify_when_done``), drained on the loop thread.

Both can also be polled from the loop (``poll_from_loop``), which bounds
delivery when the thread that should deliver is starved of the GIL.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Protocol, TypeAlias

from aiokvo.errors import PollerClosedError
from aiokvo.runtime.sources import CompletionSource

__all__ = [
    "CompletionCallback",
    "Entry",
    "LaneOwner",
    "LaneWaiter",
    "NotifiedLane",
    "assist",
]

CompletionCallback: TypeAlias = Callable[[BaseException | None], None]
"""Called on the loop thread with ``None`` on success or the source's error."""

Entry: TypeAlias = tuple[CompletionSource, CompletionCallback]
_Batch: TypeAlias = list[tuple[CompletionCallback, BaseException | None]]


class LaneOwner(Protocol):
    """What a lane needs from its poller (the loop side of the hand-over)."""

    idle_thread_timeout: float

    def _run_batch(self, batch: _Batch) -> None: ...

    def _deliver_threadsafe(self, batch: _Batch) -> bool: ...

    def _call_threadsafe(self, function: Callable[[], None]) -> bool: ...

    def _invoke(self, callback: CompletionCallback, error: BaseException | None) -> None: ...

    def _forget_notified(self, notified: NotifiedLane) -> None: ...


def assist(source: CompletionSource) -> bool:
    """Let ``source`` do overdue work on the loop thread; True if it did any."""
    helper: Callable[[], bool] | None = getattr(source, "assist", None)
    return helper is not None and helper()


class LaneWaiter:
    """One thread that waits, in order, on the sources of one lane."""

    def __init__(self, poller: LaneOwner, name: str) -> None:
        self._poller = poller
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Entry] = deque()
        self._alive = False
        self._closed = False  # stop now, dropping what is queued (the loop is gone)
        self._finishing = False  # take nothing new; exit once the queue is empty
        self._name = name

    def push(self, entry: Entry) -> None:
        with self._cond:
            if self._closed or self._finishing:
                raise PollerClosedError("the event poller is closed")
            self._queue.append(entry)
            if not self._alive:
                self._alive = True
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                thread.start()
            else:
                self._cond.notify()

    def is_empty(self) -> bool:
        """True when nothing is queued or on its way to the loop."""
        with self._cond:
            return not self._queue

    def finish(self) -> bool:
        """Take nothing new; deliver what is queued, then let the thread exit.

        Returns True when nothing was queued (the thread exits at once)."""
        with self._cond:
            self._finishing = True
            self._cond.notify()
            return not self._queue

    def close(self) -> list[Entry]:
        """Stop the thread and hand back what it had not started on."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify()
        return pending

    def _stopped(self) -> bool:
        return self._closed

    def poll_from_loop(self, loop: asyncio.AbstractEventLoop) -> bool:
        """On the loop thread: hand over every finished head; True while work remains.

        The waiter thread needs the GIL to deliver, and a loop busy running
        Python can starve it for seconds (see docs/async.md); this fallback,
        run on a 1 ms timer while sources are pending, bounds the delay. It
        pops under the same lock as the thread and schedules with
        ``call_soon``, so batches keep their order and each source is
        delivered once.
        """
        with self._cond:
            if self._closed:
                return False
            batch: list[tuple[CompletionCallback, BaseException | None]] = []
            self._pop_finished(batch)
            if batch:
                loop.call_soon(self._poller._run_batch, batch)
            return bool(self._queue)

    def _pop_finished(self, batch: list[tuple[CompletionCallback, BaseException | None]]) -> None:
        """Move finished heads, in order, from the queue to ``batch`` (lock held)."""
        while self._queue:
            source, callback = self._queue[0]
            error: BaseException | None = None
            try:
                if not source.query():
                    break
            except BaseException as exc:  # the source's failure is the result
                error = exc
            self._queue.popleft()
            batch.append((callback, error))

    def _run(self) -> None:
        timeout = self._poller.idle_thread_timeout
        while True:
            with self._cond:
                if not self._queue and not self._closed and not self._finishing:
                    self._cond.wait(timeout)
                if self._closed or not self._queue:
                    self._alive = False
                    return
                head = self._queue[0]
            source, callback = head
            error: BaseException | None = None
            try:
                source.synchronize()
            except BaseException as exc:  # the source's failure is the result
                error = exc
            batch: list[tuple[CompletionCallback, BaseException | None]] = [(callback, error)]
            with self._cond:
                if self._stopped():  # closed while we were blocked
                    self._alive = False
                    return
                if self._queue and self._queue[0] is head:
                    self._queue.popleft()
                else:  # the loop's fallback poll delivered it already
                    batch.clear()
                # Whatever else already finished rides on the same wake-up.
                self._pop_finished(batch)
                # Hand over while still holding the lock, so that a completion the
                # loop finds already done (see ``is_empty``) cannot overtake this batch.
                if batch and not self._poller._deliver_threadsafe(batch):
                    self._alive = False
                    return


class NotifiedLane:
    """A lane of :class:`NotifyingSource` s: drained on the loop when one says it is done."""

    __slots__ = ("_poller", "lane", "queue", "wake_pending")

    def __init__(self, poller: LaneOwner, lane: Hashable) -> None:
        self._poller = poller
        self.lane = lane
        self.queue: deque[Entry] = deque()
        self.wake_pending = False

    def wake(self) -> None:
        """Called by a completing source, on any thread."""
        # One scheduled drain covers every source that finished before it runs:
        # a source is complete before it calls wake, and drain clears the flag
        # before it looks at any source, so no completion is missed.
        if self.wake_pending:
            return
        self.wake_pending = True
        if not self._poller._call_threadsafe(self.drain):
            self.wake_pending = False

    def poll_from_loop(self) -> bool:
        """On the loop's fallback timer: deliver what finished, doing overdue work
        first; True while work remains. Covers a completing thread starved of the
        GIL, which can neither do the work nor send its wake-up."""
        if self.queue:
            assist(self.queue[0][0])
        self.drain()
        return bool(self.queue)

    def drain(self) -> None:
        self.wake_pending = False
        queue = self.queue
        while queue:
            source, callback = queue[0]
            error: BaseException | None = None
            try:
                if not source.query():
                    break
            except BaseException as exc:
                error = exc
            queue.popleft()
            self._poller._invoke(callback, error)
        if not queue:
            self._poller._forget_notified(self)
