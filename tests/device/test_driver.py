"""The real driver module: status checking, error names, the probe, binding versions.

These run with or without a GPU: where a device would change the answer,
``cuda.bindings.runtime`` is wrapped so the call under test returns what
the test needs, while error names still come from the real bindings.
"""

from __future__ import annotations

from typing import Any

import pytest
from cuda.bindings import runtime

from aiokvo.device import driver as driver_module
from aiokvo.device.driver import CudaDriver, RuntimeDriver, cuda_device_count, load_driver
from aiokvo.device.fake import FakeDriver
from aiokvo.errors import CudaError, CudaUnavailableError
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler
from aiokvo.layout import CanonicalKVCaches

Err = runtime.cudaError_t


class StubRuntime:
    """The real runtime module, with chosen functions replaced."""

    def __init__(self, **overrides: Any) -> None:
        self._overrides = overrides
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            replacement = self._overrides[name]

            def record(*args: Any) -> Any:
                self.calls.append((name, args))
                return replacement(*args)

            return record
        return getattr(runtime, name)


def driver_over(stub: StubRuntime, *, batch: bool = True) -> RuntimeDriver:
    """A RuntimeDriver that never touched the device (constructed around ``stub``)."""
    drv = object.__new__(RuntimeDriver)
    drv._rt = stub
    drv.device = 0
    drv._batch_ok = batch
    drv._batch_attrs = {}
    drv._stream_wrappers = {}
    return drv


def test_probe_never_raises_and_agrees_with_the_runtime() -> None:
    err, count = runtime.cudaGetDeviceCount()
    expected = int(count) if int(err) == 0 else 0
    assert cuda_device_count() == expected


def test_probe_reads_a_driver_error_as_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "cudaGetDeviceCount", lambda: (Err.cudaErrorNoDevice, None))
    assert cuda_device_count() == 0


@pytest.fixture
def no_loaded_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh process: on a GPU box an earlier test has loaded (and cached)
    the real driver, and ``load_driver`` would hand that back without probing."""
    monkeypatch.setattr(driver_module, "_drivers", {})


@pytest.mark.usefixtures("no_loaded_driver")
def test_load_driver_without_a_driver_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        runtime, "cudaGetDeviceCount", lambda: (Err.cudaErrorInsufficientDriver, None)
    )
    with pytest.raises(CudaUnavailableError, match="cudaErrorInsufficientDriver"):
        load_driver()


@pytest.mark.usefixtures("no_loaded_driver")
def test_load_driver_rejects_a_missing_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "cudaGetDeviceCount", lambda: (Err.cudaSuccess, 1))
    with pytest.raises(CudaUnavailableError, match="device 3 requested but 1 visible"):
        load_driver(3)


@pytest.mark.usefixtures("no_loaded_driver")
def test_a_cuda_handler_without_a_driver_raises_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime, "cudaGetDeviceCount", lambda: (Err.cudaErrorNoDevice, None))
    import torch

    with pytest.raises(CudaUnavailableError, match="no usable CUDA driver"):
        CudaOffloadingHandler(
            CanonicalKVCaches.from_block_tensors([[torch.zeros(2, 4, dtype=torch.int8)]]),
            [torch.zeros(2, 4, dtype=torch.int8)],
            block_size_factor=1,
            gpu_to_cpu=True,
        )


def test_failed_status_becomes_cuda_error_with_name_and_code() -> None:
    drv = driver_over(StubRuntime(cudaStreamSynchronize=lambda s: (Err.cudaErrorIllegalAddress,)))
    with pytest.raises(CudaError) as info:
        drv.stream_synchronize(0x1234)
    error = info.value
    assert error.call == "cudaStreamSynchronize"
    assert error.name == "cudaErrorIllegalAddress"
    assert error.code == int(Err.cudaErrorIllegalAddress)
    assert "cudaStreamSynchronize failed: cudaErrorIllegalAddress" in str(error)


def test_success_unpacks_single_values() -> None:
    drv = driver_over(
        StubRuntime(cudaStreamCreateWithFlags=lambda flags: (Err.cudaSuccess, 0xABC))
    )
    drv._set_device = lambda: None  # type: ignore[method-assign]
    assert drv.stream_create() == 0xABC


def test_event_query_maps_not_ready_to_false_and_raises_real_errors() -> None:
    answers = iter([(Err.cudaErrorNotReady,), (Err.cudaSuccess,), (Err.cudaErrorLaunchFailure,)])
    drv = driver_over(StubRuntime(cudaEventQuery=lambda e: next(answers)))
    assert drv.event_query(1) is False
    assert drv.event_query(1) is True
    with pytest.raises(CudaError, match="cudaErrorLaunchFailure"):
        drv.event_query(1)


@pytest.mark.parametrize(
    "returned",
    [(Err.cudaSuccess,), (Err.cudaSuccess, 0)],
    ids=["13.x returns (err,)", "12.x returns (err, failIdx)"],
)
def test_batch_copy_accepts_both_binding_generations(returned: tuple[Any, ...]) -> None:
    stub = StubRuntime(cudaMemcpyBatchAsync=lambda *args: returned)
    drv = driver_over(stub)
    drv.memcpy_batch_async([10, 20], [30, 40], [8, 8], 0x55, src_in_stream_order=True)
    ((name, args),) = stub.calls
    assert name == "cudaMemcpyBatchAsync"
    dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream = args
    assert (dsts, srcs, sizes, count, idxs, num_attrs, stream) == (
        [10, 20], [30, 40], [8, 8], 2, [0], 1, 0x55
    )
    order = runtime.cudaMemcpySrcAccessOrder
    assert attrs[0].srcAccessOrder == order.cudaMemcpySrcAccessOrderStream
    overlap = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    assert int(attrs[0].flags) == int(overlap)
    drv.memcpy_batch_async([1], [2], [3], 0x55, src_in_stream_order=False)
    assert stub.calls[1][1][4][0].srcAccessOrder == order.cudaMemcpySrcAccessOrderAny


def test_batch_copy_failure_names_the_batch_call() -> None:
    stub = StubRuntime(cudaMemcpyBatchAsync=lambda *a: (Err.cudaErrorInvalidValue, 1))
    drv = driver_over(stub)
    with pytest.raises(CudaError, match="cudaMemcpyBatchAsync failed: cudaErrorInvalidValue"):
        drv.memcpy_batch_async([1, 2], [3, 4], [5, 6], 7, src_in_stream_order=False)


def test_batch_copy_falls_back_to_a_loop_where_unsupported() -> None:
    stub = StubRuntime(
        cudaMemcpyBatchAsync=lambda *a: (Err.cudaErrorNotSupported,),
        cudaMemcpyAsync=lambda *a: (Err.cudaSuccess,),
    )
    drv = driver_over(stub)
    drv.memcpy_batch_async([1, 2], [3, 4], [5, 6], 7, src_in_stream_order=False)
    drv.memcpy_batch_async([8], [9], [10], 7, src_in_stream_order=False)
    names = [name for name, _ in stub.calls]
    assert names == ["cudaMemcpyBatchAsync"] + ["cudaMemcpyAsync"] * 3
    assert not drv.has_memcpy_batch()
    kind = runtime.cudaMemcpyKind.cudaMemcpyDefault
    assert stub.calls[1][1] == (1, 3, 5, kind, 7)


def test_batch_copy_falls_back_when_the_binding_signature_differs() -> None:
    def other_signature(*args: Any) -> Any:
        raise TypeError(f"takes 9 positional arguments but {len(args)} were given")

    stub = StubRuntime(
        cudaMemcpyBatchAsync=other_signature, cudaMemcpyAsync=lambda *a: (Err.cudaSuccess,)
    )
    drv = driver_over(stub)
    drv.memcpy_batch_async([1], [2], [3], 7, src_in_stream_order=True)
    assert [name for name, _ in stub.calls] == ["cudaMemcpyBatchAsync", "cudaMemcpyAsync"]
    assert not drv.has_memcpy_batch()


def test_loop_path_is_used_when_batching_is_absent() -> None:
    stub = StubRuntime(cudaMemcpyAsync=lambda *a: (Err.cudaSuccess,))
    drv = driver_over(stub, batch=False)
    drv.memcpy_batch_async([1, 2], [3, 4], [5, 6], 7, src_in_stream_order=True)
    assert [name for name, _ in stub.calls] == ["cudaMemcpyAsync"] * 2


def test_event_flags_are_blocking_sync_and_disable_timing_unless_timed() -> None:
    stub = StubRuntime(cudaEventCreateWithFlags=lambda flags: (Err.cudaSuccess, 0x10))
    drv = driver_over(stub)
    drv._set_device = lambda: None  # type: ignore[method-assign]
    drv.event_create(timing=False)
    drv.event_create(timing=True)
    (_, (plain,)), (_, (timed,)) = stub.calls
    assert plain == runtime.cudaEventBlockingSync | runtime.cudaEventDisableTiming
    assert timed == runtime.cudaEventBlockingSync


def test_host_register_is_portable_and_mapped() -> None:
    stub = StubRuntime(cudaHostRegister=lambda *a: (Err.cudaErrorHostMemoryAlreadyRegistered,))
    drv = driver_over(stub)
    drv._set_device = lambda: None  # type: ignore[method-assign]
    with pytest.raises(CudaError, match="cudaErrorHostMemoryAlreadyRegistered"):
        drv.host_register(0x1000, 4096)
    ((_, (ptr, size, flags)),) = stub.calls
    assert (ptr, size) == (0x1000, 4096)
    assert flags == runtime.cudaHostRegisterPortable | runtime.cudaHostRegisterMapped


def test_both_drivers_satisfy_the_protocol() -> None:
    assert isinstance(FakeDriver(), CudaDriver)
    assert isinstance(driver_over(StubRuntime()), CudaDriver)
    assert "load_driver" in driver_module.__all__
