"""``TransferTask`` (an awaitable transfer) and ``ResultQueue`` (the finished stream).

Both are shared by every handler and by the worker, so they live apart
from the handler classes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator
from functools import partial
from typing import Any

from aiokvo._util import check_int
from aiokvo.specs import TransferResult

__all__ = ["DEFAULT_MAX_BUFFERED", "FinishedResults", "ResultQueue", "ResultTap", "TransferTask"]

DEFAULT_MAX_BUFFERED = 65_536
"""Results a handler keeps for ``get_finished`` before it drops the oldest."""

DEFAULT_TAP_SIZE = 65_536
"""Results a :class:`ResultTap` keeps unread before it drops the oldest."""


class TransferTask:
    """One submitted transfer; ``await task`` gives its :class:`TransferResult`.

    Awaiting never raises for a failed copy: the result says
    ``success=False`` and carries the error. Any number of coroutines may
    await the same task. Cancelling one of them cancels only that wait; the
    copy runs to the end and its result is still reported.
    """

    __slots__ = ("_future", "_waiters", "job_id")

    def __init__(self, job_id: int, future: asyncio.Future[TransferResult]) -> None:
        self.job_id = job_id
        self._future = future
        self._waiters: list[asyncio.Future[None]] | None = None

    @classmethod
    def resolved(cls, result: TransferResult, loop: asyncio.AbstractEventLoop) -> TransferTask:
        """A task that is already done with ``result``."""
        future: asyncio.Future[TransferResult] = loop.create_future()
        future.set_result(result)
        return cls(result.job_id, future)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> TransferResult:
        """The result; raises :class:`asyncio.InvalidStateError` while running."""
        return self._future.result()

    def add_done_callback(self, callback: Callable[[TransferTask], Any]) -> None:
        """Call ``callback(task)`` on the loop once the transfer has finished."""
        self._future.add_done_callback(lambda _: callback(self))

    def _set_result(self, result: TransferResult) -> None:
        """For handlers: finish the task and wake its awaiters in the same call.

        Through the shared future alone, an awaiter would wake one loop
        iteration later (the future's callbacks are scheduled, then the
        awaiter's wake-up is): a handler that finishes its tasks here saves
        that iteration on every transfer.
        """
        self._future.set_result(result)
        waiters, self._waiters = self._waiters, None
        if waiters:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def __await__(self) -> Generator[Any, None, TransferResult]:
        future = self._future
        if not future.done():
            # Each awaiter waits on a future of its own, so cancelling it cancels
            # that wait alone, never the shared future (nor the copy). It is
            # woken by _set_result, or by the shared future's callback when the
            # task was finished some other way.
            waiter: asyncio.Future[None] = future.get_loop().create_future()
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
            future.add_done_callback(partial(_wake, waiter))
            try:
                yield from waiter.__await__()
            finally:
                waiters = self._waiters
                if waiters is not None and waiter in waiters:
                    waiters.remove(waiter)
        return future.result()

    def __repr__(self) -> str:
        if not self._future.done():
            return f"<TransferTask job_id={self.job_id} pending>"
        ok = "ok" if self._future.result().success else "failed"
        return f"<TransferTask job_id={self.job_id} {ok}>"


def _wake(waiter: asyncio.Future[None], _: object) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ResultQueue:
    """A bounded multi-consumer buffer of finished results, oldest first.

    When ``max_buffered`` results are waiting, the oldest is dropped and
    counted in :attr:`dropped`, so memory stays bounded even if nobody
    reads. ``max_buffered=0`` keeps nothing (for callers that only await
    tasks). Readers that are already waiting get results directly, so a
    live ``async for`` never loses one.
    """

    def __init__(self, max_buffered: int = DEFAULT_MAX_BUFFERED) -> None:
        self.max_buffered = check_int("max_buffered", max_buffered, minimum=0)
        self.dropped = 0
        self._items: deque[TransferResult] = deque()
        self._readers: deque[asyncio.Future[TransferResult | None]] = deque()
        self._closed = False
        self._taps: tuple[ResultTap, ...] = ()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, result: TransferResult) -> None:
        for tap in self._taps:
            tap.push(result)
        while self._readers:
            reader = self._readers.popleft()
            if not reader.done():
                reader.set_result(result)
                return
        if self.max_buffered == 0:
            self.dropped += 1
            return
        if len(self._items) >= self.max_buffered:
            self._items.popleft()
            self.dropped += 1
        self._items.append(result)

    def tap(self, maxsize: int = DEFAULT_TAP_SIZE) -> ResultTap:
        """A :class:`ResultTap` that sees every result put here from now on."""
        tap = ResultTap(self, maxsize)
        self._taps = (*self._taps, tap)
        return tap

    def _untap(self, tap: ResultTap) -> None:
        self._taps = tuple(t for t in self._taps if t is not tap)

    def take_all(self) -> list[TransferResult]:
        items = list(self._items)
        self._items.clear()
        return items

    def close(self) -> None:
        """No more results will come; readers end once the buffer is empty."""
        self._closed = True
        while self._readers:
            reader = self._readers.popleft()
            if not reader.done():
                reader.set_result(None)

    async def get(self) -> TransferResult | None:
        """The next result, or None once closed and drained."""
        if self._items:
            return self._items.popleft()
        if self._closed:
            return None
        reader: asyncio.Future[TransferResult | None] = asyncio.get_running_loop().create_future()
        self._readers.append(reader)
        try:
            return await reader
        except asyncio.CancelledError:
            if reader.done() and not reader.cancelled():
                # Handed a result in the same instant we were cancelled: keep it.
                result = reader.result()
                if result is not None:
                    self._items.appendleft(result)
            raise

    def stream(self) -> AsyncIterator[TransferResult]:
        return _ResultStream(self)


class ResultTap:
    """A bounded copy of every result a :class:`ResultQueue` sees, for exporters.

    ``get_finished()`` readers share one stream (each result goes to one of
    them, and with ``max_buffered=0`` only to a reader already waiting); a
    tap takes nothing from anyone and sees every result, whoever else reads.
    It never blocks: past ``maxsize`` unread results the oldest is dropped
    and counted in :attr:`dropped`. Exporters read it in batches with
    :meth:`drain_nowait` (a periodic task, a scrape), so the results' path
    pays one ``deque.append`` per tap. :meth:`close` detaches it.
    """

    __slots__ = ("_items", "_maxsize", "_queue", "dropped")

    def __init__(self, queue: ResultQueue, maxsize: int = DEFAULT_TAP_SIZE) -> None:
        self._maxsize = check_int("maxsize", maxsize, minimum=1)
        self._queue: ResultQueue | None = queue
        self._items: deque[TransferResult] = deque()
        self.dropped = 0
        """Results dropped unread because the tap was full."""

    def push(self, result: TransferResult) -> None:
        items = self._items
        if len(items) >= self._maxsize:
            items.popleft()
            self.dropped += 1
        items.append(result)

    def drain_nowait(self) -> list[TransferResult]:
        """Every result since the last drain, oldest first (empty when none)."""
        items = list(self._items)
        self._items.clear()
        return items

    def qsize(self) -> int:
        """Results waiting to be drained."""
        return len(self._items)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @property
    def closed(self) -> bool:
        return self._queue is None

    def close(self) -> None:
        """Stop seeing new results (what is buffered can still be drained); idempotent."""
        if self._queue is not None:
            self._queue._untap(self)
            self._queue = None


class _ResultStream:
    """``async for`` over a :class:`ResultQueue` (a class, so no async-generator
    finalisation is needed when a reader breaks out early)."""

    __slots__ = ("_queue",)

    def __init__(self, queue: ResultQueue) -> None:
        self._queue = queue

    def __aiter__(self) -> _ResultStream:
        return self

    async def __anext__(self) -> TransferResult:
        result = await self._queue.get()
        if result is None:
            raise StopAsyncIteration
        return result


class FinishedResults:
    """The finished-results half of the handler API, read from ``self._results``.

    Shared by every handler and by the worker, which only differ in what
    they put on the queue.
    """

    _results: ResultQueue

    def get_finished(self) -> AsyncIterator[TransferResult]:
        """Each finished result once, in completion order; ends after ``aclose``.

        Several readers share one stream: each result goes to one of them.
        """
        return self._results.stream()

    def get_finished_nowait(self) -> list[TransferResult]:
        """The results finished since the last read, oldest first."""
        return self._results.take_all()

    @property
    def dropped_results(self) -> int:
        """Results discarded unread because the buffer was full (or disabled)."""
        return self._results.dropped
