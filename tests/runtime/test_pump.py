"""Loop drivers: a private loop pumped inside each call, or a loop on its own thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiokvo.errors import ConfigError
from aiokvo.runtime.pump import LoopThread, PumpedLoop, make_loop_driver


@pytest.fixture(params=["pump", "thread"])
def driver(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    d = PumpedLoop() if request.param == "pump" else LoopThread()
    yield d
    d.close()


def test_call_runs_inside_the_running_loop(driver) -> None:  # type: ignore[no-untyped-def]
    def inside() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
        return asyncio.get_running_loop(), threading.current_thread()

    loop, thread = driver.call(inside)
    assert loop is driver.loop
    assert (thread is threading.current_thread()) == driver.runs_on_caller_thread


def test_call_returns_the_value_and_raises_the_error(driver) -> None:  # type: ignore[no-untyped-def]
    assert driver.call(lambda a, b: a + b, 2, 3) == 5

    def boom() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        driver.call(boom)
    assert driver.call(lambda: "still usable") == "still usable"


def test_run_waits_for_an_awaitable_finished_by_another_thread(driver) -> None:  # type: ignore[no-untyped-def]
    future = driver.call(lambda: asyncio.get_running_loop().create_future())
    timer = threading.Timer(0.02, driver.loop.call_soon_threadsafe, (future.set_result, 7))
    timer.start()
    assert driver.run(future) == 7
    timer.join()


def test_a_pumped_loop_only_delivers_inside_a_call() -> None:
    pumped = PumpedLoop()
    try:
        future = pumped.call(lambda: asyncio.get_running_loop().create_future())
        pumped.loop.call_soon_threadsafe(future.set_result, 1)
        time.sleep(0.01)
        assert not future.done()  # nobody pumped: the callback waits
        pumped.poll()
        assert future.result() == 1
    finally:
        pumped.close()


def test_a_loop_thread_makes_progress_between_calls() -> None:
    thread = LoopThread()
    try:
        future = thread.call(lambda: asyncio.get_running_loop().create_future())
        thread.loop.call_soon_threadsafe(future.set_result, 1)
        deadline = time.monotonic() + 5
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert future.result() == 1
    finally:
        thread.close()


def test_concurrent_calls_from_two_threads_are_serialised() -> None:
    pumped = PumpedLoop()
    errors: list[BaseException] = []
    inside = 0
    overlap = False

    def body() -> None:
        nonlocal inside, overlap
        inside += 1
        overlap = overlap or inside > 1
        time.sleep(0.001)
        inside -= 1

    def caller() -> None:
        try:
            for _ in range(50):
                pumped.call(body)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pumped.close()
    assert not errors and not overlap


async def test_pumping_from_inside_a_running_loop_raises_and_auto_picks_a_thread() -> None:
    pumped = PumpedLoop()
    with pytest.raises(RuntimeError, match="already runs an event loop"):
        pumped.call(lambda: None)
    pumped.close()
    auto = make_loop_driver("auto")
    try:
        assert isinstance(auto, LoopThread)
        assert auto.call(lambda: 4) == 4
    finally:
        auto.close()


def test_auto_pumps_without_a_running_loop_and_bad_modes_are_refused() -> None:
    auto = make_loop_driver()
    assert isinstance(auto, PumpedLoop)
    auto.close()
    with pytest.raises(ConfigError, match="loop driver must be one of"):
        make_loop_driver("fast")  # type: ignore[arg-type]


def test_closed_drivers_refuse_calls_and_close_twice(driver) -> None:  # type: ignore[no-untyped-def]
    driver.close()
    driver.close()
    assert driver.loop.is_closed()
    with pytest.raises(RuntimeError, match="closed"):
        driver.call(lambda: None)
