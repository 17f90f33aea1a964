"""The dispatch thread: jobs in submission order, failures per job, restart after idling."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest

from aiokvo.handlers.host import DispatchEvent, DispatchThread


def test_dispatch_thread_runs_jobs_in_order_and_restarts_after_idling() -> None:
    dispatch = DispatchThread("test-dispatch", idle_timeout=0.02)
    ran: list[int] = []
    failed = RuntimeError("boom")

    def job(n: int) -> Callable[[], tuple[()]]:
        def record() -> tuple[()]:
            if n == 3:
                raise failed
            ran.append(n)
            return ()

        return record

    for burst in range(2):  # the second burst comes after the idle thread has exited
        events = [DispatchEvent() for _ in range(8)]
        for n, event in enumerate(events):
            dispatch.submit(job(n + 10 * burst), event)
        for event in events[:-1]:
            with contextlib.suppress(RuntimeError):
                event.synchronize()
        events[-1].synchronize()
        want = [n + 10 * burst for n in range(8) if n + 10 * burst != 3]
        assert ran[-len(want) :] == want
        assert all(e.elapsed() is not None for e in events if e is not events[3] or burst)
        if burst == 0:
            failed_event = events[3]
        pause = threading.Event()
        for _ in range(1000):  # it exits after idle_timeout without work
            if not dispatch.running:
                break
            pause.wait(0.01)
        assert not dispatch.running
    with pytest.raises(RuntimeError, match="boom"):
        failed_event.query()
    dispatch.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        dispatch.submit(job(0), DispatchEvent())
