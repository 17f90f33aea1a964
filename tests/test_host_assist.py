"""A host copy whose dispatch thread is starved of the GIL is run by the event loop.

A loop that keeps running Python can keep the dispatch thread from ever
getting the GIL (the GIL convoy in docs/async.md). Here the thread is held
back with a gate instead, which is the same thing seen from the loop: the
thread never claims its work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

import aiokvo.handlers.host as host
from aiokvo.errors import ConfigError
from aiokvo.handlers.host import HostCopy, HostOffloadingHandler, _DispatchThread, _TimedHostEvent
from aiokvo.handlers.pair import make_cpu_gpu_handlers
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


@pytest.fixture
def stalled_dispatch(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Dispatch threads wait for the yielded gate before looking for work."""
    gate = threading.Event()
    real_run = _DispatchThread._run

    def stalled_run(self: _DispatchThread) -> None:
        gate.wait(timeout=30)
        real_run(self)

    monkeypatch.setattr(_DispatchThread, "_run", stalled_run)
    yield gate
    gate.set()


@pytest.mark.both_loops
@pytest.mark.parametrize("poller_mode", ["thread", "adaptive", "spin"])
async def test_the_loop_runs_copies_its_thread_never_started(
    stalled_dispatch: threading.Event, poller_mode: str
) -> None:
    caches = _caches()
    async with make_cpu_gpu_handlers(
        caches, block_size_factor=1, num_cpu_blocks=NUM_BLOCKS, poller_mode=poller_mode
    ) as handlers:
        store = handlers.gpu_to_cpu
        tasks = [store.transfer_async(job, _store(job)) for job in range(6)]
        results: list[TransferResult] = [await asyncio.wait_for(t, 10) for t in tasks]
        # The thread is still at its gate, so the loop did every copy.
        assert not stalled_dispatch.is_set()
        assert all(r.success and r.transfer_time is not None for r in results)
        assert [r.job_id for r in store.get_finished_nowait()] == list(range(6))
        cpu = handlers.cpu_tensors[0]
        for block in range(6):
            assert torch.equal(cpu[block], caches.tensors[0].tensor[block])
        assert not cpu[6:].any()
        stalled_dispatch.set()  # the woken thread finds nothing left to do
        assert (await store.transfer_async(9, _store(9))).success
        assert torch.equal(cpu[9], caches.tensors[0].tensor[9])


async def test_inline_after_none_keeps_copies_off_the_loop(
    stalled_dispatch: threading.Event,
) -> None:
    caches = _caches()
    async with make_cpu_gpu_handlers(
        caches, block_size_factor=1, num_cpu_blocks=NUM_BLOCKS, inline_after=None
    ) as handlers:
        task = handlers.gpu_to_cpu.transfer_async(1, _store(3))
        await asyncio.sleep(0.05)  # 25 times the default inline_after
        assert not task.done()
        assert not handlers.cpu_tensors[0].any()
        stalled_dispatch.set()
        assert (await asyncio.wait_for(task, 10)).success
        assert torch.equal(handlers.cpu_tensors[0][3], caches.tensors[0].tensor[3])


async def test_a_caller_copy_fn_is_never_run_on_the_loop(
    stalled_dispatch: threading.Event,
) -> None:
    ran_on: list[str] = []

    def copy(copies: Sequence[HostCopy]) -> None:
        ran_on.append(threading.current_thread().name)
        host.apply_host_copies(copies)

    async with make_cpu_gpu_handlers(
        _caches(), block_size_factor=1, num_cpu_blocks=NUM_BLOCKS, copy_fn=copy
    ) as handlers:
        task = handlers.gpu_to_cpu.transfer_async(1, _store(2))
        await asyncio.sleep(0.05)
        assert not task.done() and ran_on == []
        stalled_dispatch.set()
        assert (await asyncio.wait_for(task, 10)).success
        assert ran_on == ["aiokvo-host-g2c"]


@pytest.mark.parametrize("poller_mode", ["thread", "spin"])
async def test_thread_and_loop_racing_for_jobs_run_each_once_in_order(
    monkeypatch: pytest.MonkeyPatch, poller_mode: str
) -> None:
    """``inline_after=0``: the loop claims any job the thread has not claimed yet."""
    real = host.apply_host_copies
    ran: list[tuple[int, str]] = []

    def recording(copies: Sequence[HostCopy]) -> None:
        ran.append((int(copies[0].src_rows[0]), threading.current_thread().name))
        real(copies)

    monkeypatch.setattr(host, "apply_host_copies", recording)
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
        tasks = [store.transfer_async(job, _store(block)) for job, block in jobs]
        results = [await asyncio.wait_for(t, 10) for t in tasks]
    assert all(r.success for r in results)
    assert [r.job_id for r in results] == [job for job, _ in jobs]
    assert [block for block, _ in ran] == [block for _, block in jobs]  # once each, in order
    assert {name for _, name in ran} <= {"aiokvo-host-g2c", threading.current_thread().name}


async def test_a_copy_that_fails_on_the_loop_fails_only_its_transfer(
    stalled_dispatch: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = host.apply_host_copies
    boom = RuntimeError("injected")

    def second_fails(copies: Sequence[HostCopy]) -> None:
        if int(copies[0].src_rows[0]) == 1:
            raise boom
        real(copies)

    monkeypatch.setattr(host, "apply_host_copies", second_fails)
    caches = _caches()
    async with make_cpu_gpu_handlers(
        caches, block_size_factor=1, num_cpu_blocks=NUM_BLOCKS
    ) as handlers:
        store = handlers.gpu_to_cpu
        tasks = [store.transfer_async(job, _store(job)) for job in range(3)]
        results = [await asyncio.wait_for(t, 10) for t in tasks]
        assert [r.success for r in results] == [True, False, True]
        assert results[1].error is boom
        assert not stalled_dispatch.is_set()
        assert isinstance(store, HostOffloadingHandler)
        assert not store._dispatch._busy  # released after the failure
        assert not handlers.cpu_tensors[0][1].any()
        stalled_dispatch.set()  # so that closing can join the thread


def test_a_finished_copy_is_visible_before_its_thread_calls_set() -> None:
    """The mark (``end``) and the dispatcher's release come from the copy's own
    C-level pass, so a thread starved right after copying blocks nobody."""
    dispatch = _DispatchThread("test-mark")
    seen: list[tuple[bool, bool]] = []

    class Probe(_TimedHostEvent):
        def set(self) -> None:
            seen.append((self.query(), dispatch._busy))
            super().set()

    event = Probe(dispatch, 0.0)
    assert isinstance(event, AssistableSource)
    assert not event.query()
    dispatch._busy = True  # claimed, as _run and assist do under the lock
    host._execute((host._apply_alone, [], event, 0.0), dispatch, inline=False)
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
    assert source.wakes and poller._fallback_handle is None  # and the timer stopped


@pytest.mark.parametrize("bad", [-0.001, "0.002", True, float("nan")])
def test_inline_after_must_be_none_or_seconds(bad: object) -> None:
    caches = _caches()
    with pytest.raises(ConfigError, match="inline_after"):
        make_cpu_gpu_handlers(
            caches, block_size_factor=1, num_cpu_blocks=NUM_BLOCKS, inline_after=bad
        )
