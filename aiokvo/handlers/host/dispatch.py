"""One thread that runs jobs strictly in submission order, which the loop can help out.

The host backend runs each handler's copies here (FIFO per direction), and
a disk tier can run its file I/O the same way. It is cheaper per job than a
``ThreadPoolExecutor`` (no ``Future``, no work item, no wake-up while the
thread is busy): :meth:`DispatchThread.submit` appends to a deque and only
takes the lock to wake a sleeping thread, which drains everything queued
before it sleeps again, so a burst of small jobs costs one wake-up. It exits
after ``idle_timeout`` seconds without work and starts again on the next job.

A loop that keeps running Python can starve the thread of the GIL for
seconds (the GIL convoy, docs/async.md). Two things bound that delay:

* A job's *work* returns its steps as an iterator (for host copies, a pass of
  C-level numpy calls, :func:`~aiokvo.handlers.host.copies.host_copy_steps`).
  The steps, the completion mark (:attr:`DispatchEvent.end`) and the
  dispatcher's release run as one C-level pass, with no Python bytecode at
  which the thread could be made to yield: once started, a job never needs
  the GIL back before the loop can see it finished.
* A job the thread has not claimed ``patience`` seconds after it was queued
  is run by the loop itself when the poller polls its event
  (:meth:`DispatchEvent.assist`), in order, one job at a time either way.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import chain, starmap

from aiokvo.runtime.sources import HostEvent

__all__ = ["DispatchEvent", "DispatchThread", "ThreadFactory", "Work"]

Work = Callable[[], Iterable[object]]
"""A job: returns its steps; exhausting them does the work. A function that does
everything itself and returns ``()`` works too, but only an iterator of C-level
calls gets the convoy-proof completion described in the module docstring."""

ThreadFactory = Callable[..., threading.Thread]
"""Makes the dispatch thread: ``factory(target=..., name=..., daemon=True)``."""


class DispatchEvent(HostEvent):
    """A job's completion source, also holding its start and end as seen by
    whoever ran it (queueing time excluded): one object per job.

    ``end`` doubles as the completion mark: it is written by the job's last
    C-level step, so :meth:`query` sees the job finished even while its thread
    waits for the GIL to call ``set()``. With a ``dispatch`` and a ``patience``
    (seconds), :meth:`assist` lets the loop run overdue jobs itself.
    """

    __slots__ = ("_dispatch", "_patience", "end", "start")

    def __init__(
        self, dispatch: DispatchThread | None = None, patience: float | None = None
    ) -> None:
        super().__init__()
        self.start = 0.0
        self.end = 0.0
        self._dispatch = dispatch
        self._patience = patience

    def elapsed(self) -> float | None:
        """Seconds the job ran, once it has finished successfully."""
        return self.end - self.start if self.end else None

    def query(self) -> bool:
        return bool(self.end) or super().query()

    def assist(self) -> bool:
        """On the loop thread: run the overdue queued jobs (this one included)."""
        if self._dispatch is None or self._patience is None or self.end:
            return False
        return self._dispatch.assist(self._patience)


_Job = tuple[Work, DispatchEvent, float]


class DispatchThread:
    """One thread running jobs in submission order; see the module docstring.

    Jobs are claimed under the lock and run one at a time (:attr:`busy`), by
    the thread or, through :meth:`assist`, by the event loop when the thread
    has not claimed an overdue job: whoever claims runs it, so each job runs
    once and they start in order.
    """

    def __init__(
        self,
        name: str,
        *,
        idle_timeout: float = 5.0,
        thread_factory: ThreadFactory = threading.Thread,
    ) -> None:
        self.name = name
        self._idle_timeout = idle_timeout
        self._thread_factory = thread_factory
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._idle = True  # true from before the thread looks for work until it runs again
        self._busy = False  # a job is running, on the thread or on the loop
        self._shutdown = False

    @property
    def busy(self) -> bool:
        """A job is running now (on the thread or on the loop)."""
        return self._busy

    @property
    def running(self) -> bool:
        """The thread exists (it exits after ``idle_timeout`` without work)."""
        return self._thread is not None

    def submit(self, work: Work, event: DispatchEvent) -> None:
        """Queue ``work``; ``event`` completes (or fails with its error) when it has run."""
        if self._shutdown:
            raise RuntimeError(f"{self.name} was shut down")
        self._queue.append((work, event, time.perf_counter()))
        # The thread sets _idle (under the lock) *before* its last look at the queue,
        # and we look at _idle *after* appending: one of the two sees the other.
        if self._idle:
            with self._cond:
                if self._thread is None:
                    self._thread = self._thread_factory(
                        target=self._run, name=self.name, daemon=True
                    )
                    self._idle = False
                    self._thread.start()
                else:
                    self._cond.notify()

    def run_now(self, work: Work, event: DispatchEvent) -> bool:
        """Run ``work`` here, now, if nothing is queued or running; True if it ran.

        For small jobs, whose thread hand-off (a wake-up, a GIL hand-over, a
        wake-up back) costs more than the job: the caller does it itself, and
        ``event`` is complete when this returns. False (nothing done) when an
        earlier job is still queued or running: running this one first would
        break submission order, so the caller then :meth:`submit` s it.
        """
        if self._busy or self._queue:
            return False  # the common refusal, decided without the lock
        with self._cond:
            if self._busy or self._queue or self._shutdown:
                return False
            self._busy = True
        self._execute((work, event, 0.0), inline=True)
        return True

    def assist(self, patience: float) -> bool:
        """Run, here and in order, each queued job older than ``patience`` seconds
        that the thread has not claimed; True if any ran. For the loop thread."""
        queue = self._queue
        if self._busy:
            return False  # the common case, decided without the lock
        try:
            enqueued = queue[0][2]
        except IndexError:  # empty, or the thread took the last job just now
            return False
        if time.perf_counter() - enqueued < patience:
            return False
        ran = False
        while True:
            with self._cond:
                if self._busy or not queue or time.perf_counter() - queue[0][2] < patience:
                    if ran and queue:
                        self._cond.notify()  # the thread may be waiting for us to finish
                    return ran
                job = queue.popleft()
                self._busy = True
            self._execute(job, inline=True)
            ran = True

    def shutdown(self, *, wait: bool = True) -> None:
        """Stop the thread once the queue is empty, and join it (``wait``).

        ``wait=False`` leaves a thread stuck in a job (a hung disk) to finish
        and exit alone: it is a daemon, and takes no new jobs.
        """
        with self._cond:
            self._shutdown = True
            thread = self._thread
            self._cond.notify()
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        queue = self._queue
        cond = self._cond
        while True:
            with cond:
                if not queue or self._busy:
                    self._idle = True
                    if queue or not self._shutdown:
                        cond.wait(self._idle_timeout)
                    if not queue:
                        # Idle too long, or shut down: the next submit restarts the thread.
                        self._thread = None
                        return
                    if self._busy:
                        continue  # the loop is running a job itself; it notifies when done
                job = queue.popleft()
                self._busy = True
                self._idle = False
            self._execute(job, inline=False)

    def _execute(self, job: _Job, *, inline: bool) -> None:
        """Run one claimed job and publish its outcome; releases :attr:`busy`.

        The steps, the completion mark (``event.end``) and the release are one
        pass of C-level calls (``deque`` over ``chain``), so no Python bytecode
        runs between the job's last step and the loop being able to see it.
        """
        work, event, _ = job
        event.start = time.perf_counter()
        try:
            steps = work()
            finish = map(
                setattr,
                (event, self),
                ("end", "_busy"),
                chain(starmap(time.perf_counter, ((),)), (False,)),
            )
            deque(chain(steps, finish), maxlen=0)
        except BaseException as exc:  # the job's failure is its result
            self._busy = False
            event.set_exception(exc)
            if inline and not isinstance(exc, Exception):
                raise  # never swallow KeyboardInterrupt & co. on the loop thread
        else:
            event.set()
