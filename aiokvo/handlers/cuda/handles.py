"""CUDA events as completion sources, and pools of events and streams.

Creating and destroying events and streams costs microseconds and may
synchronise the device, so a handler keeps them in pools for its lifetime.
A pool owns everything it ever created: :meth:`HandlePool.close` destroys
the idle ones at once and each outstanding one when it comes back, so a
handle is never destroyed while work recorded on it may still run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from aiokvo.device.driver import CudaDriver
from aiokvo.errors import CudaError

__all__ = ["CudaEvent", "HandlePool", "event_pool", "stream_pool"]


class CudaEvent:
    """A :class:`~aiokvo.runtime.sources.CompletionSource` over one recorded event.

    ``query`` never blocks; ``synchronize`` blocks the calling (non-loop)
    thread, and sleeps rather than spins because pooled completion events
    are created with ``cudaEventBlockingSync``. Both raise
    :class:`~aiokvo.errors.CudaError` if the work before the event failed.

    The loop may see the event complete (``query``) while a waiter thread is
    still inside ``cudaEventSynchronize`` on it; destroying the event then
    crashes the process (seen on an H200). :meth:`after_waiters` therefore
    defers the release of the handle until the last such thread has returned.
    """

    __slots__ = ("_after", "_done", "_driver", "_lock", "_waiting", "event")

    def __init__(self, driver: CudaDriver, event: int) -> None:
        self._driver = driver
        self.event = event
        self._done = False
        self._lock = threading.Lock()
        self._waiting = 0
        self._after: Callable[[], None] | None = None

    def query(self) -> bool:
        if self._done:
            return True
        done = self._driver.event_query(self.event)
        self._done = done
        return done

    def synchronize(self) -> None:
        if self._done:
            return
        with self._lock:
            self._waiting += 1
        try:
            self._driver.event_synchronize(self.event)
            self._done = True
        finally:
            with self._lock:
                self._waiting -= 1
                action = self._after if self._waiting == 0 else None
                if action is not None:
                    self._after = None
            if action is not None:
                action()

    def after_waiters(self, action: Callable[[], None]) -> bool:
        """Run ``action`` once no thread is blocked in :meth:`synchronize`.

        Returns False when none is (the caller runs ``action`` itself, and
        sees its errors); True when ``action`` was deferred to the last
        waiter, which then runs it on its own thread.
        """
        with self._lock:
            if self._waiting == 0:
                return False
            assert self._after is None, "a CudaEvent is released once"
            self._after = action
            return True

    @property
    def completed(self) -> bool:
        """True once a query or synchronize has seen it succeed (asks nothing)."""
        return self._done

    def __repr__(self) -> str:
        return f"<CudaEvent {self.event:#x} {'done' if self._done else 'pending'}>"


class HandlePool:
    """Reusable integer handles made by ``create`` and destroyed by ``destroy``."""

    def __init__(
        self, kind: str, create: Callable[[], int], destroy: Callable[[int], None]
    ) -> None:
        self.kind = kind
        self._create = create
        self._destroy = destroy
        self._idle: list[int] = []
        self._out: set[int] = set()
        self._closed = False
        self._lock = threading.Lock()

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def outstanding(self) -> int:
        return len(self._out)

    def acquire(self) -> int:
        """An idle handle, or a new one; raises ``CudaError`` if creation fails."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.kind} pool is closed")
            handle = self._idle.pop() if self._idle else None
        if handle is None:
            handle = self._create()
        with self._lock:
            self._out.add(handle)
        return handle

    def release(self, handle: int) -> None:
        """Give ``handle`` back; only once the work recorded with it has finished."""
        with self._lock:
            self._out.remove(handle)
            if not self._closed:
                self._idle.append(handle)
                return
        self._destroy(handle)

    def discard(self, handle: int) -> None:
        """Destroy a handle whose state is unknown (e.g. after a failed enqueue)."""
        with self._lock:
            self._out.discard(handle)
        self._destroy(handle)

    def close(self) -> None:
        """Destroy the idle handles now and outstanding ones as they are released.

        Every handle is attempted; the first failure is raised afterwards.
        """
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        first: CudaError | None = None
        for handle in idle:
            try:
                self._destroy(handle)
            except CudaError as exc:
                first = first or exc
        if first is not None:
            raise first


def event_pool(driver: CudaDriver, *, timing: bool) -> HandlePool:
    """Blocking-sync events; ``timing=False`` adds ``DisableTiming`` (cheaper to record)."""
    return HandlePool(
        "timing event" if timing else "event",
        lambda: driver.event_create(timing=timing),
        driver.event_destroy,
    )


def stream_pool(driver: CudaDriver) -> HandlePool:
    """Non-blocking streams, so no copy ever serialises with the legacy default stream."""
    return HandlePool("stream", driver.stream_create, driver.stream_destroy)
