"""A host copy whose dispatch thread is starved of the GIL is run by the event loop.

A loop that keeps running Python can keep the dispatch thread from ever
getting the GIL (the GIL convoy in docs/async.md). Here the thread is held
back with a gate instead (a ``thread_factory`` whose threads wait before
looking for work), which is the same thing seen from the loop: the thread
never claims its work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from aiokvo.errors import ConfigError
from aiokvo.handlers import make_cpu_gpu_handlers
from aiokvo.handlers.host import (
    DispatchEvent,
    DispatchThread,
    HostCopy,
    HostOffloadingHandler,
    apply_host_copies,
)
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.poller import EventPoller
from aiokvo.runtime.sources import AssistableSource
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferResult, TransferSpec

NUM_BLOCKS = 16
PAGE = 64


def _caches() -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(7)
    layers = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), generator=gen, dtype=torch.int8)]
    return CanonicalKVCaches.from_engine(layers, layout="blocks_first")


def _store(block: int) -> TransferSpec:
    return (GPULoadStoreSpec([block], [1], [0]), CPULoadStoreSpec([block]))


class StalledThreads:
    """A ``thread_factory`` whose threads wait for :attr:`gate` before looking for work."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(
        self, *, target: Callable[[], None], name: str, daemon: bool
    ) -> threading.Thread:
        def stalled() -> None:
            self.gate.wait(timeout=30)
            target()

        return threading.Thread(target=stalled, name=name, daemon=daemon)

    def dispatcher(self) -> DispatchThread:
        return DispatchThread("aiokvo-host-g2c", thread_factory=self)


@pytest.fixture
def stalled() -> Iterator[StalledThreads]:
    threads = StalledThreads()
    yield threads
    threads.gate.set()


def _store_handler(
    caches: CanonicalKVCaches, dispatcher: DispatchThread, **options: object
) -> HostOffloadingHandler:
    """A store handler over a fresh pool whose copies run on ``dispatcher``."""
    return HostOffloadingHandler(
        caches,
        [torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.int8)],
        block_size_factor=1,
        gpu_to_cpu=True,
        dispatcher=dispatcher,
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.both_loops
@pytest.mark.parametrize("poller_mode", ["thread", "adaptive", "spin"])
async def test_the_loop_runs_copies_its_thread_never_started(
    stalled: StalledThreads, poller_mode: str
) -> None:
    caches = _caches()
    dispatcher = stalled.dispatcher()
    async with _store_handler(caches, dispatcher, poller_mode=poller_mode) as store:
        tasks = [store.transfer_async(job, _store(job)) for job in range(6)]
        results: list[TransferResult] = [await asyncio.wait_for(t, 10) for t in tasks]
        # The thread is still at its gate, so the loop did every copy.
        assert not stalled.gate.is_set()
        assert all(r.success and r.transfer_time is not None for r in results)
        assert [r.job_id for r in store.get_finished_nowait()] == list(range(6))
        cpu = store.cpu_tensors[0]
        for block in range(6):
            assert torch.equal(cpu[block], caches.tensors[0].tensor[block])
        assert not cpu[6:].any()
        stalled.gate.set()  # the woken thread finds nothing left to do
        assert (await store.transfer_async(9, _store(9))).success
        assert torch.equal(cpu[9], caches.tensors[0].tensor[9])
    dispatcher.shutdown()


async def test_inline_after_none_keeps_copies_off_the_loop(stalled: StalledThreads) -> None:
    caches = _caches()
    dispatcher = stalled.dispatcher()
    async with _store_handler(caches, dispatcher, inline_after=None) as store:
        task = store.transfer_async(1, _store(3))
        await asyncio.sleep(0.05)  # 25 times the default inline_after
        assert not task.done()
        assert not store.cpu_tensors[0].any()
        stalled.gate.set()
        assert (await asyncio.wait_for(task, 10)).success
        assert torch.equal(store.cpu_tensors[0][3], caches.tensors[0].tensor[3])
    dispatcher.shutdown()


async def test_a_caller_copy_fn_is_never_run_on_the_loop(stalled: StalledThreads) -> None:
    ran_on: list[str] = []

    def copy(copies: Sequence[HostCopy]) -> None:
        ran_on.append(threading.current_thread().name)
        apply_host_copies(copies)

    dispatcher = stalled.dispatcher()
    async with _store_handler(_caches(), dispatcher, copy_fn=copy) as store:
        task = store.transfer_async(1, _store(2))
        await asyncio.sleep(0.05)
        assert not task.done() and ran_on == []
        stalled.gate.set()
        assert (await asyncio.wait_for(task, 10)).success
        assert ran_on == ["aiokvo-host-g2c"]
    dispatcher.shutdown()


@pytest.mark.parametrize("poller_mode", ["thread", "spin"])
async def test_thread_and_loop_racing_for_jobs_copy_each_once_in_order(poller_mode: str) -> None:
    """``inline_after=0``: the loop claims any job the thread has not claimed yet.

    Every job writes a different GPU block into CPU block 0: only the last one
    may be left there, and every transfer reports success in order.
    """
    caches = _caches()
    async with make_cpu_gpu_handlers(
        caches,
        block_size_factor=1,
        num_cpu_blocks=NUM_BLOCKS,
        inline_after=0,
        poller_mode=poller_mode,
    ) as handlers:
        store = handlers.gpu_to_cpu
        jobs = [(job, job % NUM_BLOCKS) for job in range(300)]
        tasks = [
            store.transfer_async(job, (GPULoadStoreSpec([block], [1], [0]), CPULoadStoreSpec([0])))
            for job, block in jobs
        ]
        results = [await asyncio.wait_for(t, 10) for t in tasks]
        assert all(r.success for r in results)
        assert [r.job_id for r in results] == [job for job, _ in jobs]
        assert torch.equal(handlers.cpu_tensors[0][0], caches.tensors[0].tensor[jobs[-1][1]])


def test_dispatch_thread_and_loop_racing_run_each_job_once_in_order() -> None:
    """The loop's ``assist`` and the thread claim jobs under one lock: once each, in order."""
    dispatch = DispatchThread("test-race")
    ran: list[tuple[int, str]] = []

    def job(n: int) -> Callable[[], tuple[()]]:
        def run() -> tuple[()]:
            ran.append((n, threading.current_thread().name))
            return ()

        return run

    events = [DispatchEvent(dispatch, 0.0) for _ in range(300)]
    for n, event in enumerate(events):
        dispatch.submit(job(n), event)
        event.assist()  # as the poller does on the loop thread; patience 0: always overdue
    for event in events:
        event.synchronize()
    dispatch.shutdown()
    assert [n for n, _ in ran] == list(range(300))
    assert {name for _, name in ran} <= {"test-race", threading.current_thread().name}


async def test_a_copy_that_fails_on_the_loop_fails_only_its_transfer(
    stalled: StalledThreads,
) -> None:
    boom = RuntimeError("injected")
    caches = _caches()
    dispatcher = stalled.dispatcher()
    async with _store_handler(caches, dispatcher) as store:
        tasks = [store.transfer_async(job, _store(job)) for job in range(3)]
        # The loop runs the default copy itself; make the second job's copy fail by
        # handing it a job that raises, through the dispatcher the handler uses.
        failing = DispatchEvent(dispatcher, 0.0)

        def fails() -> tuple[()]:
            raise boom

        dispatcher.submit(fails, failing)
        tasks.append(store.transfer_async(3, _store(3)))
        results = [await asyncio.wait_for(t, 10) for t in tasks]
        assert all(r.success for r in results)
        with pytest.raises(RuntimeError, match="injected"):
            failing.query()
        assert not stalled.gate.is_set()
        assert not dispatcher.busy  # released after the failure
        for block in range(4):
            assert torch.equal(store.cpu_tensors[0][block], caches.tensors[0].tensor[block])
        stalled.gate.set()  # so that closing can join the thread
    dispatcher.shutdown()


def test_a_finished_job_is_visible_before_its_thread_calls_set() -> None:
    """The mark (``end``) and the dispatcher's release come from the job's own
    C-level pass, so a thread starved right after its job blocks nobody."""
    dispatch = DispatchThread("test-mark")
    seen: list[tuple[bool, bool]] = []
    started = threading.Event()
    release = threading.Event()

    class Probe(DispatchEvent):
        def set(self) -> None:
            seen.append((self.query(), dispatch.busy))
            super().set()

    def hold() -> tuple[()]:
        started.set()
        release.wait(10)
        return ()

    dispatch.submit(hold, DispatchEvent())  # keeps the thread busy while we queue the probe
    assert started.wait(10)
    event = Probe(dispatch, 0.0)
    assert isinstance(event, AssistableSource)
    dispatch.submit(lambda: iter(()), event)
    assert not event.query()
    release.set()
    event.synchronize()
    dispatch.shutdown()
    assert seen == [(True, False)]
    assert event.elapsed() is not None and event.elapsed() >= 0  # type: ignore[operator]


async def test_fallback_poll_delivers_a_notifying_source_whose_thread_never_wakes() -> None:
    class SilentSource:
        """Completes, but its thread never gets to call the wake-up."""

        def __init__(self) -> None:
            self.done = False
            self.wakes: list[Callable[[], None]] = []

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            raise AssertionError("a notifying source needs no waiter thread")

        def notify_when_done(self, wake: Callable[[], None]) -> None:
            self.wakes.append(wake)

    poller = EventPoller.current()
    source = SilentSource()
    future = poller.watch("silent-lane", source, mode="thread")
    await asyncio.sleep(0.01)
    assert not future.done()
    source.done = True
    await asyncio.wait_for(future, 5)  # found by the loop's 1 ms fallback poll
    stats = poller.statistics()
    assert source.wakes and not stats.fallback_armed  # and the timer stopped
    assert stats.fallback_polls >= 1 and stats.pending == 0


@pytest.mark.parametrize("bad", [-0.001, "0.002", True, float("nan")])
def test_inline_after_must_be_none_or_seconds(bad: object) -> None:
    caches = _caches()
    with pytest.raises(ConfigError, match="inline_after"):
        make_cpu_gpu_handlers(
            caches, block_size_factor=1, num_cpu_blocks=NUM_BLOCKS, inline_after=bad
        )
