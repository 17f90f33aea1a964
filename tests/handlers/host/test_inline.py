"""Small host copies made inside ``transfer_async`` when the dispatch thread is idle.

Handing a small copy to the dispatch thread and its completion back costs
more than the copy (``benchmarks/bench_transfer_path.py``), so a transfer
below ``inline_below_bytes`` is copied by the caller, but only when nothing
of that direction is queued or running: submission order holds.
"""

from __future__ import annotations

import pytest
import torch

from aiokvo.errors import ConfigError
from aiokvo.handlers import make_cpu_gpu_handlers
from aiokvo.handlers.host import DispatchThread, HostOffloadingHandler
from aiokvo.layout import CanonicalKVCaches
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec
from tests.handlers.host.test_assist import StalledThreads

NUM_BLOCKS = 16
PAGE = 64


def _caches() -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(3)
    layers = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), generator=gen, dtype=torch.int8)]
    return CanonicalKVCaches.from_engine(layers, layout="blocks_first")


def _store(*blocks: int) -> TransferSpec:
    return (GPULoadStoreSpec(list(blocks), [len(blocks)], [0]), CPULoadStoreSpec(list(blocks)))


async def test_a_small_copy_is_made_before_transfer_async_returns() -> None:
    caches = _caches()
    async with make_cpu_gpu_handlers(caches, block_size_factor=1,
                                     num_cpu_blocks=NUM_BLOCKS) as pair:
        handler = pair.gpu_to_cpu
        assert isinstance(handler, HostOffloadingHandler)
        task = handler.transfer_async(1, _store(3, 5))
        pool = pair.cpu_tensors[0]
        assert torch.equal(pool[[3, 5]], caches.tensors[0].tensor[[3, 5]])  # already there
        assert not handler.dispatcher.running  # no thread was needed
        result = await task
        assert result.success and result.transfer_size == 2 * PAGE


async def test_a_small_copy_behind_queued_work_waits_its_turn() -> None:
    caches = _caches()
    stalled = StalledThreads()
    g2c = DispatchThread("test-g2c", thread_factory=stalled)
    async with make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=NUM_BLOCKS,
                                     inline_after=30.0) as pair:
        handler = pair.gpu_to_cpu
        own = HostOffloadingHandler(caches, pair.cpu_tensors, block_size_factor=1,
                                    gpu_to_cpu=True, inline_below_bytes=3 * PAGE,
                                    inline_after=30.0, dispatcher=g2c)
        try:
            first = own.transfer_async(1, _store(0, 1, 2))  # 3 pages: to the thread
            second = own.transfer_async(2, _store(7))  # small, but behind the first
            pool = pair.cpu_tensors[0]
            assert not torch.equal(pool[7], caches.tensors[0].tensor[7])
            assert not first.done() and not second.done()
            finished: list[int] = []
            first.add_done_callback(lambda t: finished.append(t.job_id))
            second.add_done_callback(lambda t: finished.append(t.job_id))
            stalled.gate.set()
            assert (await second).success and (await first).success
            assert finished == [1, 2]
            assert torch.equal(pool[[0, 1, 2, 7]], caches.tensors[0].tensor[[0, 1, 2, 7]])
        finally:
            stalled.gate.set()
            await own.aclose()
            g2c.shutdown()
        assert handler.in_flight == 0


@pytest.mark.parametrize("options", [{"inline_below_bytes": 0}, {"inline_after": None}])
async def test_inline_copies_can_be_turned_off(options: dict[str, object]) -> None:
    caches = _caches()
    stalled = StalledThreads()
    dispatcher = DispatchThread("test-g2c", thread_factory=stalled)
    pool = [torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8)]
    kwargs: dict[str, object] = {"inline_after": 30.0, **options}
    handler = HostOffloadingHandler(caches, pool, block_size_factor=1, gpu_to_cpu=True,
                                    dispatcher=dispatcher, **kwargs)  # type: ignore[arg-type]
    try:
        task = handler.transfer_async(1, _store(4))
        assert not pool[0][4].any()  # not copied by the caller
        stalled.gate.set()
        assert (await task).success
        assert torch.equal(pool[0][4], caches.tensors[0].tensor[4])
    finally:
        stalled.gate.set()
        await handler.aclose()
        dispatcher.shutdown()


def test_a_bad_inline_threshold_is_a_config_error() -> None:
    caches = _caches()
    pool = [torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8)]
    with pytest.raises(ConfigError, match="inline_below_bytes"):
        HostOffloadingHandler(caches, pool, block_size_factor=1, gpu_to_cpu=True,
                              inline_below_bytes=-1)
