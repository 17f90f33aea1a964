"""Handler and worker statistics, over the host backend: counts, bytes and copy
time per direction, failures, work in flight, and the results kept or dropped."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from aiokvo.handlers import HandlerStatistics, OffloadingWorker, make_cpu_gpu_handlers
from aiokvo.handlers.host import HostCopy, apply_host_copies
from aiokvo.layout import CanonicalKVCaches
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

PAGE = 256


def caches() -> CanonicalKVCaches:
    return CanonicalKVCaches.from_engine([torch.ones(8, PAGE, dtype=torch.int8)] * 1)


def store(block: int) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    return GPULoadStoreSpec([block], [1], [0]), CPULoadStoreSpec([block])


@pytest.mark.both_loops
async def test_handler_counts_finished_failed_bytes_and_time() -> None:
    failing = {2}

    def copy(copies: Sequence[HostCopy]) -> None:
        if int(copies[0].dst_rows[0]) in failing:
            raise RuntimeError("injected")
        apply_host_copies(copies)

    async with make_cpu_gpu_handlers(
        caches(), block_size_factor=1, num_cpu_blocks=8, copy_fn=copy
    ) as pair:
        handler = pair.gpu_to_cpu
        assert handler.statistics() == HandlerStatistics(transfer_type=("GPU", "CPU"))
        results = [await handler.transfer_async(job, store(job)) for job in range(4)]
        assert [r.success for r in results] == [True, True, False, True]
        s = handler.statistics()
        assert (s.completed, s.failed, s.in_flight, s.submitted) == (4, 1, 0, 4)
        assert s.bytes == 3 * PAGE
        assert s.seconds == pytest.approx(sum(r.transfer_time or 0 for r in results if r.success))
        assert (s.buffered_results, s.dropped_results) == (4, 0)  # nobody read the stream
        assert len(handler.get_finished_nowait()) == 4
        assert handler.statistics().buffered_results == 0
        assert pair.cpu_to_gpu.statistics().completed == 0


async def test_worker_reports_in_flight_work_and_every_handler() -> None:
    gate = threading.Event()

    def held(copies: Sequence[HostCopy]) -> None:
        gate.wait(10)
        apply_host_copies(copies)

    pair = make_cpu_gpu_handlers(caches(), block_size_factor=1, num_cpu_blocks=8, copy_fn=held)
    async with OffloadingWorker(max_buffered=0) as worker:
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, pair.gpu_to_cpu)
        worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, pair.cpu_to_gpu)
        tasks = [worker.transfer_async(job, store(job)) for job in range(3)]
        s = worker.statistics()
        assert s.in_flight == 3
        assert [h.in_flight for h in s.handlers] == [3, 0]
        gate.set()
        for task in tasks:
            assert (await task).success
        s = worker.statistics()
        assert (s.in_flight, s.submit_failures) == (0, 0)
        assert [h.completed for h in s.handlers] == [3, 0]
        assert (s.buffered_results, s.dropped_results) == (0, 3)  # max_buffered=0 keeps none

