"""``DaemonPool``: a few daemon threads for blocking control calls that may hang.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the
interpreter exits, so one call stuck in a dead server (a Mooncake ``setup()``
against a silent master, a lookup on a hung NFS mount) holds up the exit of
the whole process. A tier's control calls run here instead: daemon threads
that take work from one queue, each call's result on a
:class:`concurrent.futures.Future`. A stuck call keeps its thread; the others
go on, and the process can still exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DaemonPool"]

_T = TypeVar("_T")
_Job = tuple[Callable[[], Any], Future[Any]] | None


class DaemonPool:
    """Up to ``threads`` daemon threads named ``name-<n>``, started as work arrives."""

    def __init__(self, threads: int, name: str) -> None:
        self._max = threads
        self._name = name
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._waiting = 0  # threads waiting for work
        self._closed = False

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn()`` on a pool thread; raises RuntimeError once shut down."""
        future: Future[_T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is shut down")
            self._queue.put((fn, future))
            if self._waiting == 0 and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def shutdown(self, *, wait: bool = False, cancel_futures: bool = False) -> None:
        """Take no more work; idle threads exit, busy ones after their call.

        ``cancel_futures`` cancels the calls not started yet; ``wait`` joins the
        threads (for a thread that can afford to wait, never the loop).
        """
        with self._lock:
            already = self._closed
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            pending: list[_Job] = []
            while True:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for job in pending:
                if job is not None:
                    job[1].cancel()
        if not already or cancel_futures:
            for _ in threads:
                self._queue.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._waiting += 1
            job = self._queue.get()
            with self._lock:
                self._waiting -= 1
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
