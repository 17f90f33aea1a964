"""Completion sources: things that finish, which the event poller watches.

A source is the narrow waist between a backend and the asyncio layer. It
only has to answer "are you done?" without blocking (``query``) and to
block a *non-loop* thread until it is (``synchronize``). Both raise the
failure if the operation behind the source failed, so the poller can turn
it into a failed future without knowing anything about the backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["AssistableSource", "CompletionSource", "HostEvent"]

_LAZY_LOCK = threading.Lock()


@runtime_checkable
class CompletionSource(Protocol):
    """Something that completes once; see the module docstring."""

    def query(self) -> bool:
        """True when complete, False while pending; raises if it failed."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until complete; raises if it failed."""
        ...


@runtime_checkable
class AssistableSource(CompletionSource, Protocol):
    """A source whose work waits on a Python thread, which the loop can do itself.

    A loop that keeps running Python can starve another Python thread of
    the GIL for seconds (docs/async.md, "GIL convoy"). The poller calls
    ``assist()`` on the loop thread for a lane's oldest pending source;
    when the thread that should do the work has not started it in time,
    the source does it right there, in order, and returns True. It returns
    False, quickly, when the work is under way or not yet overdue.
    """

    def assist(self) -> bool: ...


class _Flag:
    """The part of ``threading.Event`` a :class:`HostEvent` uses, made cheap.

    A ``threading.Event`` builds a ``Condition`` in Python (several
    microseconds); one ``HostEvent`` is made per host transfer, and almost
    nobody blocks on it (the poller is woken by ``notify_when_done``). So
    the flag is a plain attribute and the real event is only made for a
    thread that actually waits.
    """

    __slots__ = ("_blocker", "_flag")

    def __init__(self) -> None:
        self._flag = False
        self._blocker: threading.Event | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        # Flag first, then look for a blocker; ``wait`` installs its blocker first,
        # then looks at the flag: one of the two always sees the other.
        self._flag = True
        blocker = self._blocker
        if blocker is not None:
            blocker.set()

    def wait(self) -> None:
        if self._flag:
            return
        with _LAZY_LOCK:
            if self._blocker is None:
                self._blocker = threading.Event()
            blocker = self._blocker
        if not self._flag:
            blocker.wait()


class HostEvent:
    """A completion source set by a host worker thread.

    ``set()`` marks success and ``set_exception()`` failure; either may be
    called once from any thread. It is also a ``NotifyingSource``: the
    completing thread wakes the poller itself, so the ``thread`` poller mode
    needs no waiter thread for host copies. Made once per host transfer, so
    it is kept cheap (no ``threading.Event`` unless a thread blocks in
    :meth:`synchronize`).
    """

    __slots__ = ("_error", "_event", "_lock", "_wakes")

    def __init__(self) -> None:
        self._event = _Flag()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._wakes: list[Callable[[], None]] = []

    def set(self) -> None:
        self._event.set()
        self._fire()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._event.set()
        self._fire()

    def notify_when_done(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once when complete (at once if already complete)."""
        with self._lock:
            if not self._event.is_set():
                self._wakes.append(wake)
                return
        wake()

    def _fire(self) -> None:
        with self._lock:
            wakes, self._wakes = self._wakes, []
        for wake in wakes:
            wake()

    def query(self) -> bool:
        if not self._event.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error
