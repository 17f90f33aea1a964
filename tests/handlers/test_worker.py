"""OffloadingWorker: routing, routing errors, submission failures, merged results."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from aiokvo.errors import (
    ConfigError,
    DuplicateJobError,
    DuplicateRouteError,
    HandlerClosedError,
    HandlerOwnedError,
    TransferSpecError,
    UnknownRouteError,
)
from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.worker import OffloadingWorker
from aiokvo.runtime.sources import HostEvent
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec, TransferSpec

STORE: TransferSpec = (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
LOAD: TransferSpec = (CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1], [0]))


class DiskSpec(CPULoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "DISK"


class RecordingHandler(SingleDirectionHandler):
    """Copies complete when the test sets ``sources[job_id]``; ``fail`` makes
    the next submission raise it (as a broken backend would)."""

    def __init__(self, src: str, dst: str) -> None:
        super().__init__((src, dst))
        self.sources: dict[int, HostEvent] = {}
        self.released: Counter[int] = Counter()
        self.fail: Exception | None = None
        self.closed_backend = False

    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        if self.fail is not None:
            raise self.fail
        source = self.sources[job_id] = HostEvent()
        return Submission(source, 4096, self, release=lambda: self.released.update([job_id]))

    async def _close_backend(self) -> None:
        self.closed_backend = True


def make_worker() -> tuple[OffloadingWorker, RecordingHandler, RecordingHandler]:
    worker = OffloadingWorker()
    store, load = RecordingHandler("GPU", "CPU"), RecordingHandler("CPU", "GPU")
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, load)
    return worker, store, load


@pytest.mark.both_loops
async def test_routes_by_media_and_merges_results_in_completion_order() -> None:
    worker, store, load = make_worker()
    async with worker:
        store_task = worker.transfer_async(1, STORE)
        load_task = worker.transfer_async(2, LOAD)
        assert list(store.sources) == [1]
        assert list(load.sources) == [2]
        load.sources[2].set()
        assert (await load_task).transfer_type == ("CPU", "GPU")
        store.sources[1].set()
        assert (await store_task).transfer_type == ("GPU", "CPU")
        assert store.get_finished_nowait() == [] == load.get_finished_nowait()
        merged = worker.get_finished_nowait()
        assert [r.job_id for r in merged] == [2, 1]


async def test_async_stream_merges_all_handlers_and_ends_on_close() -> None:
    worker, store, load = make_worker()
    seen: list[int] = []

    async def read() -> None:
        async for result in worker.get_finished():
            seen.append(result.job_id)

    reader = asyncio.ensure_future(read())
    for job in range(20):
        worker.transfer_async(job, STORE if job % 2 else LOAD)
    for job in range(20):
        (store if job % 2 else load).sources[job].set()
    await worker.aclose()
    await asyncio.wait_for(reader, 5)
    assert sorted(seen) == list(range(20))
    assert store.closed_backend and load.closed_backend


async def test_registering_a_route_twice_names_it() -> None:
    worker, _, _ = make_worker()
    with pytest.raises(DuplicateRouteError, match="GPU->CPU"):
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, RecordingHandler("GPU", "CPU"))
    assert set(worker.routes) == {("GPU", "CPU"), ("CPU", "GPU")}
    await worker.aclose()


async def test_unknown_route_names_it_and_submits_nothing() -> None:
    worker, store, load = make_worker()
    async with worker:
        with pytest.raises(UnknownRouteError, match=r"CPU->DISK.*registered: GPU->CPU, CPU->GPU"):
            worker.transfer_async(1, (CPULoadStoreSpec([0]), DiskSpec([0])))
        assert not store.sources and not load.sources


async def test_malformed_spec_raises_a_spec_error() -> None:
    async with OffloadingWorker() as worker:
        bad: object = (CPULoadStoreSpec([0]),)
        with pytest.raises(TransferSpecError, match="tuple of LoadStoreSpec"):
            worker.transfer_async(1, bad)  # type: ignore[arg-type]


async def test_job_ids_are_unique_across_handlers_while_live() -> None:
    worker, store, load = make_worker()
    async with worker:
        first = worker.transfer_async(7, STORE)
        with pytest.raises(DuplicateJobError, match="job_id 7"):
            worker.transfer_async(7, LOAD)
        assert not load.sources
        store.sources[7].set()
        await first
        again = worker.transfer_async(7, LOAD)  # free again once finished
        load.sources[7].set()
        assert (await again).success


async def test_spec_errors_from_a_handler_raise_at_once() -> None:
    worker, store, _ = make_worker()
    store.fail = TransferSpecError("block 99 out of range")
    async with worker:
        with pytest.raises(TransferSpecError, match="block 99"):
            worker.transfer_async(1, STORE)
        assert worker.get_finished_nowait() == []
        assert worker.statistics().submit_failures == 0  # a caller bug is not a failure


async def test_other_submission_errors_become_failed_results() -> None:
    worker, store, _ = make_worker()
    boom = RuntimeError("stream pool exhausted")
    store.fail = boom
    async with worker:
        task = worker.transfer_async(1, STORE)
        assert task.done()
        result = await task
        assert result.success is False
        assert result.error is boom
        assert result.transfer_type == ("GPU", "CPU")
        assert worker.get_finished_nowait() == [result]
        store.fail = None
        ok = worker.transfer_async(1, STORE)  # the loop and the worker carry on
        store.sources[1].set()
        assert (await ok).success
        stats = worker.statistics()
        assert (stats.submit_failures, stats.in_flight) == (1, 0)
        assert [h.completed for h in stats.handlers] == [1, 0]  # the handler saw one copy


async def test_wait_spans_handlers_and_aclose_waits_for_copies() -> None:
    worker, store, load = make_worker()
    tasks = [worker.transfer_async(1, STORE), worker.transfer_async(2, LOAD)]
    waiter = asyncio.ensure_future(worker.wait([1, 2]))
    closer = asyncio.ensure_future(worker.aclose())
    await asyncio.sleep(0.01)
    assert not waiter.done() and not closer.done()
    with pytest.raises(HandlerClosedError):
        worker.transfer_async(3, STORE)
    store.sources[1].set()
    load.sources[2].set()
    await asyncio.wait_for(asyncio.gather(waiter, closer), 5)
    assert all(t.done() for t in tasks)
    assert store.released == Counter({1: 1}) and load.released == Counter({2: 1})
    with pytest.raises(HandlerClosedError):
        worker.register_handler(CPULoadStoreSpec, DiskSpec, RecordingHandler("CPU", "DISK"))


async def test_one_handler_may_serve_several_routes() -> None:
    worker = OffloadingWorker(max_buffered=4)
    handler = RecordingHandler("CPU", "*")
    spec_cls: type[LoadStoreSpec]
    for spec_cls in (GPULoadStoreSpec, DiskSpec):
        worker.register_handler(CPULoadStoreSpec, spec_cls, handler)
    async with worker:
        for job in range(10):
            worker.transfer_async(job, (CPULoadStoreSpec([0]), DiskSpec([0])))
            handler.sources[job].set()
        await worker.wait(range(10))
    assert [r.job_id for r in worker.get_finished_nowait()] == [6, 7, 8, 9]
    assert worker.dropped_results == 6


async def test_results_buffered_before_registration_move_to_the_worker() -> None:
    handler = RecordingHandler("GPU", "CPU")
    early = handler.transfer_async(1, STORE)
    handler.sources[1].set()
    await early
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    async with worker:
        late = worker.transfer_async(2, STORE)
        handler.sources[2].set()
        await late
        assert handler.get_finished_nowait() == []
        assert [r.job_id for r in worker.get_finished_nowait()] == [1, 2]


async def test_a_handler_registered_with_another_worker_is_refused() -> None:
    first, second = OffloadingWorker(), OffloadingWorker()
    handler = RecordingHandler("GPU", "CPU")
    first.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    with pytest.raises(HandlerOwnedError, match="already registered with"):
        second.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    assert second.routes == {}  # nothing changed on the refusing side
    async with first, second:
        task = first.transfer_async(1, STORE)
        handler.sources[1].set()
        await task
        # The result still reaches the first worker's readers.
        assert [r.job_id for r in first.get_finished_nowait()] == [1]
        assert second.get_finished_nowait() == []


def test_a_bad_poller_mode_in_the_environment_raises_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokvo.errors import ConfigError
    from aiokvo.runtime.poller import POLLER_MODE_ENV

    monkeypatch.setenv(POLLER_MODE_ENV, "turbo")
    with pytest.raises(ConfigError, match="'turbo'"):
        RecordingHandler("GPU", "CPU")  # where the handlers are built
    monkeypatch.delenv(POLLER_MODE_ENV)
    handler = RecordingHandler("GPU", "CPU")
    monkeypatch.setenv(POLLER_MODE_ENV, "turbo")  # set after the handlers were built

    async def main() -> None:
        async with OffloadingWorker() as worker:
            worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
            for job in range(2):  # a ConfigError naming it each time, not failed results
                with pytest.raises(ConfigError, match=r"AIOKVO_POLLER_MODE.*'turbo'"):
                    worker.transfer_async(job, STORE)
            assert worker.get_finished_nowait() == []

    asyncio.run(main())  # a fresh loop, so the poller is made (and fails) on first use


async def test_a_result_tap_sees_every_result_and_takes_none_from_readers() -> None:
    worker = OffloadingWorker(max_buffered=0)  # as the Offloader builds it: nothing kept
    store, load = RecordingHandler("GPU", "CPU"), RecordingHandler("CPU", "GPU")
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
    tap = worker.tap_results(maxsize=3)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, load)  # registered after the tap
    store.fail = RuntimeError("no stream")
    failed = worker.transfer_async(9, STORE)  # a submit failure is reported too
    store.fail = None
    async with worker:
        tasks = [worker.transfer_async(job, STORE if job % 2 else LOAD) for job in range(4)]
        for job, task in enumerate(tasks):
            (store if job % 2 else load).sources[job].set()
            assert (await task).job_id == job  # the awaiter still gets its result
        # Five results, room for three: the two oldest were dropped and counted.
        assert [r.job_id for r in tap.drain_nowait()] == [1, 2, 3]
        assert tap.dropped == 2
        assert (await failed).success is False
        assert worker.statistics().dropped_results == 5  # max_buffered=0 kept none itself
        assert tap.drain_nowait() == [] and tap.qsize() == 0
        tap.close()
        tap.close()  # idempotent
        assert tap.closed
        worker.transfer_async(7, LOAD)
        load.sources[7].set()
    assert tap.drain_nowait() == []  # closed: it saw nothing more


async def test_a_tap_refuses_a_bad_size() -> None:
    worker, _, _ = make_worker()
    with pytest.raises(ConfigError, match="maxsize"):
        worker.tap_results(maxsize=0)
