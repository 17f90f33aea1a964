"""EventPoller: per-lane order, every mode, failures, idling, closing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import get_args

import pytest

from aiokvo.errors import ConfigError, PollerClosedError
from aiokvo.runtime.poller import (
    DEFAULT_POLLER_MODE,
    POLLER_MODE_ENV,
    EventPoller,
    NotifyingSource,
    PollerMode,
    resolve_poller_mode,
)
from aiokvo.runtime.sources import HostEvent


class WaitOnlyEvent(HostEvent):
    """A HostEvent the poller can only query or wait on (as it waits on a CUDA event).

    ``HostEvent`` wakes the poller itself; hiding ``notify_when_done`` makes
    these tests exercise the polling and waiter-thread paths device sources use.
    """

    notify_when_done = None  # type: ignore[assignment]


MODES = get_args(PollerMode)


class CountingSource(WaitOnlyEvent):
    """A HostEvent that counts how often it was polled."""

    __slots__ = ("queries",)

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return super().query()


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for ``condition`` without assuming how fast a loaded machine is."""
    deadline = time.perf_counter() + timeout
    while not condition():
        assert time.perf_counter() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def poller() -> EventPoller:
    return EventPoller.current()


@pytest.mark.both_loops
@pytest.mark.parametrize("mode", MODES)
async def test_watch_resolves_each_lane_in_order(mode: PollerMode, poller: EventPoller) -> None:
    order: list[tuple[str, int]] = []
    sources = {lane: [WaitOnlyEvent() for _ in range(20)] for lane in ("a", "b")}
    futures = []
    for lane, lane_sources in sources.items():
        for i, source in enumerate(lane_sources):
            future = poller.watch(lane, source, mode=mode)
            future.add_done_callback(lambda _, lane=lane, i=i: order.append((lane, i)))
            futures.append(future)
    # Finish lane b backwards and lane a forwards, from another thread.
    thread = threading.Thread(
        target=lambda: [s.set() for s in [*reversed(sources["b"]), *sources["a"]]]
    )
    thread.start()
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    thread.join()
    for lane in ("a", "b"):
        assert [i for name, i in order if name == lane] == list(range(20))


@pytest.mark.both_loops
@pytest.mark.parametrize("mode", MODES)
async def test_a_failed_source_fails_its_future_and_later_ones_still_resolve(
    mode: PollerMode, poller: EventPoller
) -> None:
    bad, good = WaitOnlyEvent(), WaitOnlyEvent()
    bad_future = poller.watch("lane", bad, mode=mode)
    good_future = poller.watch("lane", good, mode=mode)
    error = OSError("copy failed")
    asyncio.get_running_loop().call_later(0.002, bad.set_exception, error)
    asyncio.get_running_loop().call_later(0.002, good.set)
    with pytest.raises(OSError) as caught:
        await asyncio.wait_for(bad_future, 5)
    assert caught.value is error
    await asyncio.wait_for(good_future, 5)


@pytest.mark.parametrize("mode", ["spin", "adaptive"])
async def test_only_the_oldest_source_of_a_lane_is_polled(
    mode: PollerMode, poller: EventPoller
) -> None:
    first, second, other_lane = CountingSource(), CountingSource(), CountingSource()
    futures = [
        poller.watch("lane", first, mode=mode),
        poller.watch("lane", second, mode=mode),
        poller.watch("other", other_lane, mode=mode),
    ]
    await asyncio.sleep(0.01)
    assert first.queries > 0
    assert other_lane.queries > 0  # lanes are independent
    assert second.queries == 0
    second.set()
    other_lane.set()
    await asyncio.sleep(0.01)
    assert not futures[1].done()  # finished, but behind a pending head
    first.set()
    await asyncio.wait_for(asyncio.gather(*futures), 5)


async def test_one_poller_per_loop(poller: EventPoller) -> None:
    loop = asyncio.get_running_loop()
    assert EventPoller.current() is poller
    assert EventPoller.for_loop(loop) is poller
    assert EventPoller.existing(loop) is poller
    with pytest.raises(ConfigError, match="already has an EventPoller"):
        EventPoller(loop)
    other = asyncio.new_event_loop()
    try:
        assert EventPoller.for_loop(other) is not poller
    finally:
        other.close()


@pytest.mark.parametrize("mode", MODES)
async def test_an_idle_poller_uses_no_cpu_and_schedules_nothing(mode: PollerMode) -> None:
    poller = EventPoller(mode=mode, idle_thread_timeout=0.05)
    source = WaitOnlyEvent()
    future = poller.watch("lane", source)
    asyncio.get_running_loop().call_later(0.002, source.set)
    await asyncio.wait_for(future, 5)
    await until(lambda: poller.active_threads == 0)  # an idle waiter thread exits
    assert poller.pending == 0
    assert poller._tick_handle is None

    wall0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.sleep(0.3)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert cpu < 0.3 * wall, f"idle poller burned {cpu:.3f}s CPU in {wall:.3f}s"


@pytest.mark.parametrize("mode", ["adaptive", "thread"])
async def test_a_long_wait_does_not_spin(mode: PollerMode) -> None:
    poller = EventPoller(mode=mode, spin_budget=0.001)
    source = WaitOnlyEvent()
    future = poller.watch("lane", source)
    await asyncio.sleep(0.01)  # past the spin budget
    wall0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.sleep(0.3)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert not future.done()
    assert cpu < 0.5 * wall, f"waiting burned {cpu:.3f}s CPU in {wall:.3f}s"
    source.set()
    await asyncio.wait_for(future, 5)


async def test_thread_mode_restarts_a_waiter_that_exited_while_idle() -> None:
    poller = EventPoller(mode="thread", idle_thread_timeout=0.02)
    for _ in range(3):
        source = WaitOnlyEvent()
        future = poller.watch("lane", source)
        threading.Timer(0.001, source.set).start()
        await asyncio.wait_for(future, 5)
        await until(lambda: poller.active_threads == 0)


@pytest.mark.parametrize("mode", MODES)
async def test_close_refuses_new_work_and_reports_pending_sources_only_once_done(
    mode: PollerMode,
) -> None:
    poller = EventPoller(mode=mode)
    ok, failing = WaitOnlyEvent(), WaitOnlyEvent()
    first = poller.watch("lane", ok)
    second = poller.watch("lane", failing)
    await asyncio.sleep(0.005)
    poller.close()
    poller.close()  # idempotent
    with pytest.raises(PollerClosedError):
        poller.watch("lane", WaitOnlyEvent())
    await asyncio.sleep(0.02)
    # The copies behind the sources are still running: nothing may be reported yet.
    assert not first.done() and not second.done()
    fresh = EventPoller.current()
    assert fresh is not poller and not fresh.closed
    failure = RuntimeError("copy failed")
    ok.set()
    failing.set_exception(failure)
    assert await asyncio.wait_for(first, 5) is None  # its own outcome, not a closed error
    with pytest.raises(RuntimeError, match="copy failed"):
        await asyncio.wait_for(second, 5)
    await until(lambda: poller.active_threads == 0 and poller.pending == 0)
    fresh.close()


@pytest.mark.parametrize("mode", MODES)
async def test_a_raising_callback_is_reported_and_polling_goes_on(mode: PollerMode) -> None:
    poller = EventPoller(mode=mode)
    contexts: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: contexts.append(ctx))

    def explode(error: BaseException | None) -> None:
        raise ValueError("callback bug")

    first, second = WaitOnlyEvent(), WaitOnlyEvent()
    poller.add_callback("lane", first, explode)
    future = poller.watch("lane", second)
    first.set()
    second.set()
    await asyncio.wait_for(future, 5)
    assert any(isinstance(ctx.get("exception"), ValueError) for ctx in contexts)


def test_mode_comes_from_argument_then_environment_then_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(POLLER_MODE_ENV, raising=False)
    assert resolve_poller_mode() == DEFAULT_POLLER_MODE
    monkeypatch.setenv(POLLER_MODE_ENV, "spin")
    assert resolve_poller_mode() == "spin"
    assert resolve_poller_mode("adaptive") == "adaptive"
    monkeypatch.setenv(POLLER_MODE_ENV, "turbo")
    with pytest.raises(ConfigError, match=f"{POLLER_MODE_ENV}.*'turbo'"):
        resolve_poller_mode()
    with pytest.raises(ConfigError, match="'nope'"):
        resolve_poller_mode("nope")


async def test_env_var_sets_the_mode_of_new_pollers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLLER_MODE_ENV, "adaptive")
    assert EventPoller.current().mode == "adaptive"


async def test_bad_settings_name_the_value() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(ConfigError, match="-1"):
        EventPoller(loop, spin_budget=-1)
    with pytest.raises(ConfigError, match="0"):
        EventPoller(loop, idle_thread_timeout=0)


@pytest.mark.parametrize("mode", MODES)
async def test_sources_already_done_when_watched_keep_their_place(mode: PollerMode) -> None:
    poller = EventPoller(mode=mode)
    order: list[int] = []
    pending: list[HostEvent] = []
    futures = []
    for i in range(60):
        source = WaitOnlyEvent()
        if i % 3 == 0:
            source.set()  # e.g. an empty copy: finished before it is watched
        else:
            pending.append(source)
        future = poller.watch("lane", source)
        future.add_done_callback(lambda _, i=i: order.append(i))
        futures.append(future)
        if i % 10 == 9:
            await asyncio.sleep(0.001)  # let some deliveries interleave with new watches

    def finish() -> None:
        for source in pending:
            source.set()
            time.sleep(0.0002)

    thread = threading.Thread(target=finish)
    thread.start()
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    thread.join()
    assert order == list(range(60))


async def test_thread_mode_skips_the_thread_for_sources_already_done() -> None:
    poller = EventPoller(mode="thread")
    done = WaitOnlyEvent()
    done.set()
    await asyncio.wait_for(poller.watch("lane", done), 5)
    assert poller.active_threads == 0


@pytest.mark.both_loops
async def test_notifying_sources_need_no_waiter_thread_and_keep_lane_order() -> None:
    poller = EventPoller(mode="thread")
    assert isinstance(HostEvent(), NotifyingSource)
    order: list[int] = []
    sources = [HostEvent() for _ in range(50)]
    sources[0].set()  # done before it is watched: woken at once
    futures = []
    for i, source in enumerate(sources):
        future = poller.watch("lane", source)
        future.add_done_callback(lambda _, i=i: order.append(i))
        futures.append(future)
    failure = ValueError("bad page")
    sources[7].set_exception(failure)
    later = [s for i, s in enumerate(sources) if i not in (0, 7)]
    thread = threading.Thread(target=lambda: [s.set() for s in reversed(later)])
    thread.start()
    outcomes = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 5)
    thread.join()
    assert order == list(range(50))
    assert outcomes[7] is failure
    assert poller.active_threads == 0
    assert poller.pending == 0


async def test_close_reports_pending_notifying_sources_once_done() -> None:
    poller = EventPoller(mode="thread")
    source = HostEvent()
    future = poller.watch("lane", source)
    poller.close()
    await asyncio.sleep(0.02)
    assert not future.done()
    threading.Timer(0.001, source.set).start()  # completed by another thread
    assert await asyncio.wait_for(future, 5) is None


def test_close_after_the_loop_closed_reports_nothing() -> None:
    loop = asyncio.new_event_loop()
    calls: list[BaseException | None] = []

    async def watch() -> EventPoller:
        poller = EventPoller(mode="thread")
        poller.add_callback("lane", WaitOnlyEvent(), calls.append)
        return poller

    poller = loop.run_until_complete(watch())
    loop.close()
    poller.close()  # from a thread without a loop: lets the waiter go
    assert calls == [] and poller.pending == 0
    assert poller.statistics().dropped_on_stop == 1


def test_a_bad_mode_in_the_environment_is_a_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(POLLER_MODE_ENV, "turbo")
    loop = asyncio.new_event_loop()
    try:
        for _ in range(2):  # every use says so, not only the first
            with pytest.raises(ConfigError, match=f"{POLLER_MODE_ENV}.*'turbo'"):
                EventPoller.for_loop(loop)
        assert EventPoller.existing(loop) is None
    finally:
        loop.close()


class StarvedWaiterSource:
    """Completes when ``done`` is set, but its ``synchronize`` stays blocked until
    ``release`` — a waiter thread that cannot get the GIL behind a busy loop."""

    def __init__(self) -> None:
        self.done = False
        self.release = threading.Event()

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.release.wait(10)


@pytest.mark.both_loops
async def test_thread_mode_delivers_from_the_loop_when_the_waiter_is_starved() -> None:
    poller = EventPoller(mode="thread")
    first, second = StarvedWaiterSource(), StarvedWaiterSource()
    calls: list[tuple[str, BaseException | None]] = []
    poller.add_callback("lane", first, lambda e: calls.append(("first", e)))
    poller.add_callback("lane", second, lambda e: calls.append(("second", e)))
    second.done = True
    await asyncio.sleep(0.02)
    assert calls == []  # the head is not done: order holds, nothing overtakes it
    first.done = True
    await until(lambda: len(calls) == 2)
    assert calls == [("first", None), ("second", None)]
    first.release.set()  # the waiter thread wakes late: it must not deliver again
    second.release.set()
    await asyncio.sleep(0.05)
    assert calls == [("first", None), ("second", None)]
    assert poller.pending == 0
    poller.close()


async def test_thread_mode_fallback_poll_stops_when_nothing_is_pending() -> None:
    poller = EventPoller(mode="thread")
    source = StarvedWaiterSource()
    future = poller.watch("lane", source)
    source.done = True
    await asyncio.wait_for(future, 5)
    await asyncio.sleep(0.01)
    assert not poller.statistics().fallback_armed  # no timer left running while idle
    source.release.set()
    poller.close()


@pytest.mark.parametrize("mode", MODES)
async def test_statistics_follow_lanes_deliveries_errors_and_close(mode: PollerMode) -> None:
    poller = EventPoller(mode=mode)
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: None)

    def buggy(error: BaseException | None) -> None:
        raise ValueError("callback bug")

    first, second, stuck = WaitOnlyEvent(), WaitOnlyEvent(), WaitOnlyEvent()
    poller.add_callback("a", first, lambda error: None)
    poller.add_callback("b", second, buggy)
    poller.watch("c", stuck).add_done_callback(lambda f: f.exception())
    stats = poller.statistics()
    assert (stats.mode, stats.pending, stats.delivered, stats.closed) == (mode, 3, 0, False)
    if mode == "thread":
        assert stats.waiter_lanes == 3 and stats.fallback_armed
    else:
        assert stats.polled_lanes == 3
    first.set()
    second.set()
    await until(lambda: poller.statistics().delivered == 2)
    stats = poller.statistics()
    assert (stats.pending, stats.callback_errors) == (1, 1)
    poller.close()
    stats = poller.statistics()
    assert (stats.closed, stats.pending) == (True, 1)  # still watched after close
    stuck.set()
    await until(lambda: poller.statistics().delivered == 3)
    assert (poller.statistics().pending, poller.statistics().dropped_on_stop) == (0, 0)
