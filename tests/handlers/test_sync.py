"""SyncOffloadingWorker: the async worker driven from plain synchronous code.

These tests are synchronous on purpose: no event loop runs on the test
thread, as on vLLM's model-runner thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from aiokvo.device.fake import FakeDriver
from aiokvo.errors import DuplicateJobError, TransferSpecError
from aiokvo.handlers import OffloadingWorker, make_cpu_gpu_handlers
from aiokvo.handlers.cuda.pair import make_cuda_handlers
from aiokvo.handlers.host import HostCopy, apply_host_copies
from aiokvo.handlers.sync import SyncOffloadingWorker
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.pump import LoopThread, PumpedLoop
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

BLOCKS = 16


class Copies:
    """A ``copy_fn`` that fails the next ``fail`` copies and records the threads."""

    def __init__(self) -> None:
        self.fail = 0
        self.calls = 0
        self.threads: set[str] = set()

    def __call__(self, copies: Sequence[HostCopy]) -> None:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.fail:
            self.fail -= 1
            raise OSError("injected copy failure")
        apply_host_copies(copies)


class Rig:
    def __init__(self, driver_kind: str, retries: int = 2) -> None:
        gen = torch.Generator().manual_seed(7)
        self.layers = [torch.randn(BLOCKS, 4, 32, generator=gen) for _ in range(2)]
        self.caches = CanonicalKVCaches.from_engine(self.layers)
        self.copies = Copies()
        handlers = make_cpu_gpu_handlers(
            self.caches, block_size_factor=1, num_cpu_blocks=8, copy_fn=self.copies
        )
        self.cpu = handlers.cpu_tensors
        worker = OffloadingWorker()
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu)
        worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu)
        self.driver = PumpedLoop() if driver_kind == "pump" else LoopThread()
        self.sync = SyncOffloadingWorker(worker, self.driver, retries=retries)

    def close(self) -> None:
        self.sync.close()
        self.driver.close()


@pytest.fixture(params=["pump", "thread"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = Rig(request.param)
    yield r
    r.close()


def store(gpu: list[int], cpu: list[int]) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    return GPULoadStoreSpec(gpu, [len(gpu)], [0]), CPULoadStoreSpec(cpu)


def load(cpu: list[int], gpu: list[int]) -> tuple[CPULoadStoreSpec, GPULoadStoreSpec]:
    return CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu, [len(gpu)], [0])


def drain(sync: SyncOffloadingWorker, job_ids: set[int]) -> dict[int, bool]:
    sync.wait(job_ids)
    return {r.job_id: r.success for r in sync.get_finished()}


def test_a_store_and_a_load_round_trip_byte_for_byte(rig: Rig) -> None:
    expected = [layer[[1, 2]].clone() for layer in rig.layers]
    rig.sync.submit(1, store([1, 2], [5, 6]))
    assert drain(rig.sync, {1}) == {1: True}
    for layer in rig.layers:
        layer[[9, 10]] = float("nan")  # poison the destination
    rig.sync.submit(2, load([5, 6], [9, 10]))
    assert drain(rig.sync, {2}) == {2: True}
    for layer, want in zip(rig.layers, expected, strict=True):
        assert torch.equal(layer[[9, 10]], want)


def test_results_come_from_get_finished_once_without_wait(rig: Rig) -> None:
    for job in range(4):
        rig.sync.submit(job, store([job], [job]))
    seen: list[int] = []
    for _ in range(10_000):
        seen += [r.job_id for r in rig.sync.get_finished()]
        if len(seen) == 4:
            break
    assert sorted(seen) == [0, 1, 2, 3]
    assert rig.sync.get_finished() == []
    assert rig.sync.statistics().in_flight == 0


def test_a_failed_copy_is_retried_and_then_succeeds(rig: Rig) -> None:
    rig.copies.fail = 2
    rig.sync.submit(1, store([3], [3]))
    assert drain(rig.sync, {1}) == {1: True}
    assert torch.equal(rig.cpu[0][3], rig.caches.tensors[0].tensor[3])
    stats = rig.sync.statistics()
    assert (stats.retried, stats.succeeded, stats.failed) == (2, 1, 0)
    assert rig.copies.calls == 3


def test_a_copy_that_keeps_failing_is_reported_failed_after_its_retries(rig: Rig) -> None:
    rig.copies.fail = 10
    rig.sync.submit(1, store([3], [3]))
    rig.sync.wait({1})
    (result,) = rig.sync.get_finished()
    assert not result.success and isinstance(result.error, OSError)
    assert rig.copies.calls == 3  # 1 + retries
    assert rig.sync.statistics().failed == 1


def test_no_retries_means_the_first_failure_is_reported() -> None:
    rig = Rig("pump", retries=0)
    try:
        rig.copies.fail = 1
        rig.sync.submit(1, store([0], [0]))
        assert drain(rig.sync, {1}) == {1: False}
        assert rig.copies.calls == 1
    finally:
        rig.close()


def test_caller_bugs_raise_at_submit_and_enqueue_nothing(rig: Rig) -> None:
    with pytest.raises(TransferSpecError):
        rig.sync.submit(1, store([BLOCKS + 5], [0]))  # no such GPU block
    assert rig.sync.statistics().submitted == 0
    rig.copies.fail = 1  # a long job, so job 2 is still in flight below
    rig.sync.submit(2, store([0], [0]))
    with pytest.raises(DuplicateJobError):
        rig.sync.submit(2, store([1], [1]))
    assert drain(rig.sync, {2}) == {2: True}
    assert rig.copies.calls == 2


def test_wait_ignores_unknown_ids(rig: Rig) -> None:
    rig.sync.wait({123, 456})
    rig.sync.submit(1, store([0], [0]))
    rig.sync.wait({1, 999})
    assert [r.job_id for r in rig.sync.get_finished()] == [1]


@pytest.mark.parametrize("kind", ["pump", "thread"])
def test_a_load_waits_for_the_callers_compute_stream(kind: str) -> None:
    # The CUDA handler on the fake driver: the "engine" zeroes the destination
    # block on its own current stream (per thread, as torch's) before the load
    # is submitted. Pumping enqueues on this thread and so waits for that
    # stream; a loop thread must be handed the stream at submission.
    fake = FakeDriver()
    compute = fake.stream_create()
    fake.set_current_stream(compute)
    layers = [torch.randn(BLOCKS, 4, 32) for _ in range(2)]
    caches = CanonicalKVCaches.from_engine(layers)
    captured: list[int] = []
    options: dict[str, object] = {}
    before_submit = None
    if kind == "thread":
        options["producer_stream"] = lambda: captured[-1]
        before_submit = lambda: captured.append(fake.current_stream())  # noqa: E731
    handlers = make_cuda_handlers(
        caches, block_size_factor=1, num_cpu_blocks=4, driver=fake, **options
    )
    handlers.cpu_tensors[0][2].fill_(33)
    worker = OffloadingWorker()
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu)
    driver = PumpedLoop() if kind == "pump" else LoopThread()
    sync = SyncOffloadingWorker(worker, driver, before_submit=before_submit)
    try:
        gate = fake.hold(compute)
        fake.enqueue_host(compute, lambda: caches.tensors[0].tensor[7].zero_())
        sync.submit(1, load([2], [7]))
        gate.set()
        assert drain(sync, {1}) == {1: True}
        assert torch.all(caches.tensors[0].tensor[7] == 33)
    finally:
        sync.close()
        driver.run(handlers.aclose())
        driver.close()
        fake.set_current_stream(None)
        fake.close()
