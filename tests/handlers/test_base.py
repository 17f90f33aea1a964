"""SingleDirectionHandler machinery, driven by a fake backend whose copies
complete when the test (or a thread, or a loop timer) says so."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from typing import get_args

import pytest

from aiokvo.errors import (
    ConfigError,
    DuplicateJobError,
    HandlerClosedError,
    TransferSpecError,
)
from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.task import TransferTask
from aiokvo.runtime.poller import PollerMode
from aiokvo.runtime.sources import HostEvent
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec

MODES = get_args(PollerMode)
PAGE = 4096


def make_spec(n: int = 1) -> TransferSpec:
    return (GPULoadStoreSpec(list(range(n)), [n], [0]), CPULoadStoreSpec(list(range(n))))


class FakeHandler(SingleDirectionHandler):
    """Each copy is a HostEvent in ``self.sources`` that nobody sets unless
    ``auto_delay`` (seconds, via ``loop.call_later``) is given."""

    def __init__(
        self,
        *,
        poller_mode: PollerMode | None = None,
        max_buffered: int = 65_536,
        auto_delay: float | None = None,
        elapsed: float | None = None,
    ) -> None:
        super().__init__(("GPU", "CPU"), poller_mode=poller_mode, max_buffered=max_buffered)
        self.sources: dict[int, HostEvent] = {}
        self.released: Counter[int] = Counter()
        self.auto_delay = auto_delay
        self.elapsed = elapsed
        self.backend_closed_with_in_flight: int | None = None

    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        src, dst = spec
        if len(src) != len(dst):  # type: ignore[arg-type]
            raise TransferSpecError(f"{len(src)} source blocks but {len(dst)} destinations")  # type: ignore[arg-type]
        source = HostEvent()
        self.sources[job_id] = source
        if self.auto_delay is not None:
            asyncio.get_running_loop().call_later(self.auto_delay, source.set)
        elapsed = None if self.elapsed is None else (lambda: self.elapsed)
        return Submission(
            source=source,
            transfer_size=PAGE * len(src),  # type: ignore[arg-type]
            lane="fake",
            elapsed=elapsed,
            release=lambda: self.released.update([job_id]),
        )

    async def _close_backend(self) -> None:
        self.backend_closed_with_in_flight = self.in_flight


def set_from_thread(sources: list[HostEvent]) -> threading.Thread:
    thread = threading.Thread(target=lambda: [s.set() for s in sources])
    thread.start()
    return thread


@pytest.mark.both_loops
@pytest.mark.parametrize("mode", MODES)
async def test_results_come_in_submission_order_even_if_sources_finish_backwards(
    mode: PollerMode,
) -> None:
    async with FakeHandler(poller_mode=mode) as handler:
        tasks = [handler.transfer_async(job, make_spec()) for job in range(40)]
        for job in reversed(range(40)):
            handler.sources[job].set()
        results = [await t for t in tasks]
        assert [r.job_id for r in results] == list(range(40))
        assert [r.job_id for r in handler.get_finished_nowait()] == list(range(40))


@pytest.mark.parametrize("mode", MODES)
async def test_result_fields_describe_the_transfer(mode: PollerMode) -> None:
    async with FakeHandler(poller_mode=mode, auto_delay=0.001) as handler:
        result = await handler.transfer_async(7, make_spec(3))
    assert result.job_id == 7
    assert result.success is True
    assert result.error is None
    assert result.transfer_size == 3 * PAGE
    assert result.transfer_type == ("GPU", "CPU")
    assert result.transfer_time is not None and result.transfer_time > 0


async def test_elapsed_hook_overrides_wall_time() -> None:
    async with FakeHandler(auto_delay=0.001, elapsed=123.5) as handler:
        result = await handler.transfer_async(1, make_spec())
    assert result.transfer_time == 123.5


@pytest.mark.both_loops
@pytest.mark.parametrize("mode", MODES)
async def test_cancel_storm_reports_every_result_once_and_releases_everything(
    mode: PollerMode,
) -> None:
    n = 1000
    handler = FakeHandler(poller_mode=mode)
    tasks = [handler.transfer_async(job, make_spec()) for job in range(n)]
    awaiters = [asyncio.ensure_future(_await(t)) for t in tasks]
    await asyncio.sleep(0)
    for awaiter in awaiters[::2]:
        awaiter.cancel()
    setter = set_from_thread([handler.sources[j] for j in range(n)])
    outcomes = await asyncio.gather(*awaiters, return_exceptions=True)
    setter.join()
    await handler.aclose()

    cancelled = [o for o in outcomes if isinstance(o, asyncio.CancelledError)]
    assert len(cancelled) == n // 2
    awaited = [o for o in outcomes if not isinstance(o, BaseException)]
    assert {r.job_id for r in awaited} == set(range(1, n, 2))
    reported = [r.job_id for r in handler.get_finished_nowait()]
    assert sorted(reported) == list(range(n))  # each exactly once
    assert reported == list(range(n))  # and in order
    assert all(t.done() and t.result().success for t in tasks)
    assert handler.released == Counter(range(n))
    assert handler.in_flight == 0


async def _await(task: TransferTask) -> object:
    return await task


@pytest.mark.parametrize("mode", MODES)
async def test_aclose_waits_for_copies_in_flight_then_closes_backend(mode: PollerMode) -> None:
    handler = FakeHandler(poller_mode=mode)
    tasks = [handler.transfer_async(job, make_spec()) for job in range(10)]
    closer = asyncio.ensure_future(handler.aclose())
    await asyncio.sleep(0.02)
    assert not closer.done()
    assert handler.in_flight == 10
    with pytest.raises(HandlerClosedError, match="job_id 99"):
        handler.transfer_async(99, make_spec())
    set_from_thread(list(handler.sources.values())).join()
    await closer
    assert all(t.done() for t in tasks)
    assert handler.backend_closed_with_in_flight == 0
    assert handler.released == Counter(range(10))
    await handler.aclose()  # idempotent


@pytest.mark.both_loops
@pytest.mark.parametrize("mode", MODES)
async def test_failed_source_gives_unsuccessful_result_not_an_exception(mode: PollerMode) -> None:
    async with FakeHandler(poller_mode=mode) as handler:
        ok = handler.transfer_async(1, make_spec())
        bad = handler.transfer_async(2, make_spec())
        boom = RuntimeError("dma engine on fire")
        handler.sources[1].set()
        handler.sources[2].set_exception(boom)
        good_result, bad_result = await ok, await bad
    assert good_result.success
    assert bad_result.success is False
    assert bad_result.error is boom
    assert handler.released == Counter({1: 1, 2: 1})
    assert [r.success for r in handler.get_finished_nowait()] == [True, False]


async def test_duplicate_live_job_id_raises_and_enqueues_nothing() -> None:
    async with FakeHandler() as handler:
        first = handler.transfer_async(5, make_spec())
        with pytest.raises(DuplicateJobError, match="job_id 5"):
            handler.transfer_async(5, make_spec())
        assert handler.in_flight == 1
        handler.sources[5].set()
        await first
        again = handler.transfer_async(5, make_spec())  # reusable once finished
        handler.sources[5].set()
        assert (await again).success
    assert handler.released == Counter({5: 2})


async def test_caller_bug_in_submit_raises_before_anything_is_live() -> None:
    async with FakeHandler() as handler:
        bad = (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0]))
        with pytest.raises(TransferSpecError, match="2 source blocks but 1"):
            handler.transfer_async(1, bad)
        assert handler.in_flight == 0
        with pytest.raises(TransferSpecError, match="'x'"):
            handler.transfer_async("x", make_spec())  # type: ignore[arg-type]


async def test_memory_stays_bounded_when_nobody_reads_get_finished() -> None:
    async with FakeHandler(max_buffered=16, auto_delay=0) as handler:
        for job in range(100):
            assert (await handler.transfer_async(job, make_spec())).success
        assert len(handler._results) == 16
        assert handler.dropped_results == 84
        assert [r.job_id for r in handler.get_finished_nowait()] == list(range(84, 100))


async def test_max_buffered_zero_keeps_nothing_but_tasks_still_resolve() -> None:
    async with FakeHandler(max_buffered=0, auto_delay=0) as handler:
        results = [await handler.transfer_async(job, make_spec()) for job in range(20)]
        assert all(r.success for r in results)
        assert handler.get_finished_nowait() == []
        assert handler.dropped_results == 20


async def test_a_waiting_reader_is_handed_results_that_the_buffer_would_not_keep() -> None:
    handler = FakeHandler(max_buffered=0)  # nothing is buffered: only a handoff delivers
    seen: list[int] = []

    async def read() -> None:
        async for result in handler.get_finished():
            seen.append(result.job_id)

    reader = asyncio.ensure_future(read())
    for job in range(30):
        await asyncio.sleep(0)  # the reader is parked in the stream
        task = handler.transfer_async(job, make_spec())
        handler.sources[job].set()
        await task
        await asyncio.wait_for(_until(lambda job=job: len(seen) == job + 1), 5)
    await handler.aclose()
    await asyncio.wait_for(reader, 5)  # the stream ends once the handler is closed
    assert seen == list(range(30))
    assert handler.dropped_results == 0


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def test_several_readers_share_the_stream_without_duplicates() -> None:
    handler = FakeHandler(auto_delay=0.001)
    seen: list[list[int]] = [[], []]

    async def read(i: int) -> None:
        async for result in handler.get_finished():
            seen[i].append(result.job_id)
            await asyncio.sleep(0)

    readers = [asyncio.ensure_future(read(i)) for i in range(2)]
    tasks = [handler.transfer_async(job, make_spec()) for job in range(50)]
    await asyncio.gather(*(_await(t) for t in tasks))
    await handler.aclose()
    await asyncio.gather(*readers)
    assert sorted(seen[0] + seen[1]) == list(range(50))


async def test_wait_returns_when_jobs_finish_and_cancelling_it_spares_the_copy() -> None:
    async with FakeHandler() as handler:
        tasks = [handler.transfer_async(job, make_spec()) for job in range(3)]
        waiter = asyncio.ensure_future(handler.wait([0, 1, 12345]))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        handler.sources[0].set()
        handler.sources[1].set()
        await asyncio.wait_for(waiter, 5)
        assert tasks[0].done() and tasks[1].done() and not tasks[2].done()

        doomed = asyncio.ensure_future(handler.wait([2]))
        await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert not tasks[2].done()
        handler.sources[2].set()
        assert (await tasks[2]).success


async def test_task_api_result_callbacks_and_shared_awaiting() -> None:
    async with FakeHandler() as handler:
        task = handler.transfer_async(3, make_spec())
        assert not task.done()
        with pytest.raises(asyncio.InvalidStateError):
            task.result()
        called: list[TransferTask] = []
        task.add_done_callback(called.append)
        two = asyncio.gather(_await(task), _await(task))
        handler.sources[3].set()
        first, second = await two
        assert first is second is task.result()
        await asyncio.sleep(0)
        assert called == [task]
        assert "job_id=3 ok" in repr(task)


def test_bad_configuration_names_the_value() -> None:
    with pytest.raises(ConfigError, match="-1"):
        FakeHandler(max_buffered=-1)
    with pytest.raises(ConfigError, match="'warp'"):
        FakeHandler(poller_mode="warp")  # type: ignore[arg-type]


async def test_failing_release_hook_is_reported_not_raised() -> None:
    class LeakyHandler(FakeHandler):
        def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
            submission = super()._submit(job_id, spec)

            def release() -> None:
                raise RuntimeError("pool corrupted")

            submission.release = release
            return submission

    seen: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx))
    async with LeakyHandler(auto_delay=0) as handler:
        result = await handler.transfer_async(1, make_spec())
    assert result.success
    assert any("release" in str(ctx["message"]) for ctx in seen)
