"""DaemonPool: control calls on daemon threads, one stuck call holding up neither the
others nor the process's exit."""

from __future__ import annotations

import threading
import time

import pytest

from aiokvo.runtime.daemons import DaemonPool


def test_calls_run_on_daemon_threads_with_results_and_errors() -> None:
    pool = DaemonPool(2, "t")
    assert pool.submit(lambda: 6 * 7).result(10) == 42
    names = pool.submit(lambda: (threading.current_thread().name,
                                 threading.current_thread().daemon)).result(10)  # fmt: skip
    assert names[0].startswith("t-") and names[1] is True
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 // 0).result(10)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def test_a_stuck_call_does_not_hold_up_the_next() -> None:
    pool = DaemonPool(2, "t")
    gate = threading.Event()
    stuck = pool.submit(lambda: gate.wait(60))
    assert pool.submit(lambda: "free").result(30) == "free"
    assert not stuck.done()
    pool.shutdown()  # returns at once, the stuck thread is left to finish
    gate.set()
    assert stuck.result(30) is True


@pytest.mark.system
def test_a_process_exits_with_a_call_stuck_in_the_pool() -> None:
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from aiokvo.runtime.daemons import DaemonPool\n"
        "p = DaemonPool(1, 'x'); p.submit(threading.Event().wait); print('exiting')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 0 and b"exiting" in done.stdout


def test_shutdown_can_cancel_what_has_not_started_and_wait_for_what_has() -> None:
    pool = DaemonPool(1, "t")
    gate = threading.Event()
    running = pool.submit(lambda: gate.wait(60))
    queued = pool.submit(lambda: "never")
    stopper = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True})
    stopper.start()
    for _ in range(3000):  # shutdown cancels the queued call before it waits (no clock race)
        if queued.cancelled():
            break
        time.sleep(0.01)
    assert queued.cancelled() and not running.done()
    gate.set()
    stopper.join(30)
    assert not stopper.is_alive() and running.result(1) is True and queued.cancelled()
