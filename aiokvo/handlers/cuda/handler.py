"""One direction of GPU <-> pinned-CPU copies on CUDA streams.

Each transfer is enqueued on a pooled non-blocking stream, in this order:

1. wait for the *producer* (compute) stream -- torch's current stream
   by default -- as it stands when ``transfer_async`` is called: a store
   then reads the KV data the model has finished writing, and a load
   writes after the work already queued on those GPU blocks (the engine
   zeroing freshly allocated blocks, a forward still reading them);
2. wait for the previous transfer's end event, so a direction is FIFO;
3. the timing start event (optional), the copies (DMA or the SM kernel,
   see :mod:`~aiokvo.handlers.cuda.engines`), the timing stop event;
4. the completion event (``BlockingSync|DisableTiming``), which the
   poller's waiter thread synchronises on.

The copy plan, the descriptor table, the stream and the events of a
transfer stay referenced until its completion event has fired; then
``release`` gives them back to their pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from aiokvo._util import check_int
from aiokvo.device.driver import CudaDriver, RuntimeDriver, load_driver
from aiokvo.errors import ConfigError, CudaError
from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.cuda.engines import (
    DEFAULT_KERNEL_BELOW_BYTES,
    DescriptorBuffer,
    DmaBatch,
    DmaEngine,
    EngineMode,
    EngineName,
    KernelEngine,
    check_engine_mode,
    choose_engine,
    coalesce,
)
from aiokvo.handlers.cuda.handles import CudaEvent, HandlePool, event_pool, stream_pool
from aiokvo.layout import CanonicalKVCaches
from aiokvo.plan import PointerPlan, RowSpace, TensorLike, TransferPlanner
from aiokvo.runtime.poller import PollerMode
from aiokvo.specs import TransferSpec

_WAITER_RETURN_TIMEOUT = 5.0
"""Seconds close waits for waiter threads to hand back finished transfers' handles."""

logger = logging.getLogger(__name__)

__all__ = ["CudaOffloadingHandler", "ProducerStream"]

ProducerStream = int | Callable[[], int] | None
"""The stream whose queued work a transfer must wait for (the engine's compute
stream): a handle, a function giving one at each submission, or None for
torch's current stream on the submitting thread."""


class _Transfer:
    """Everything one in-flight transfer keeps alive until its end event fires."""

    __slots__ = (
        "__weakref__",
        "descriptors",
        "end",
        "engine",
        "plan",
        "producer_event",
        "source",
        "stream",
        "timing",
    )

    def __init__(self) -> None:
        self.stream: int | None = None
        self.end: int | None = None
        self.producer_event: int | None = None
        self.timing: list[int] = []  # start, stop (filled one by one: no leak on failure)
        self.plan: PointerPlan | None = None
        self.descriptors: DescriptorBuffer | None = None
        self.engine: EngineName = "dma"
        self.source: CudaEvent | None = None


class CudaOffloadingHandler(SingleDirectionHandler):
    """Copies between CUDA KV-cache tensors and pinned CPU tensors, one direction.

    The constructor has the host backend's shape: ``cpu_tensors[i]`` is the
    pinned pool of canonical tensor ``i`` of ``kv_caches`` (a row holds
    ``block_size_factor`` GPU pages). ``engine`` is ``"auto"`` (pick per
    transfer by page size against ``kernel_below_bytes``), ``"dma"`` or
    ``"kernel"``. With ``timing`` the reported ``transfer_time`` is the
    device time between two timing events; otherwise it is wall time.
    ``driver`` defaults to the real CUDA driver, which raises
    :class:`~aiokvo.errors.CudaUnavailableError` when there is none.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_tensors: Sequence[TensorLike],
        *,
        block_size_factor: int,
        gpu_to_cpu: bool,
        driver: CudaDriver | None = None,
        engine: EngineMode = "auto",
        kernel_below_bytes: int = DEFAULT_KERNEL_BELOW_BYTES,
        timing: bool = True,
        producer_stream: ProducerStream = None,
        coalesce_copies: bool = True,
        poller_mode: PollerMode | None = "thread",
        max_buffered: int | None = None,
    ) -> None:
        transfer_type = ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU")
        if max_buffered is None:
            super().__init__(transfer_type, poller_mode=poller_mode)
        else:
            super().__init__(transfer_type, poller_mode=poller_mode, max_buffered=max_buffered)
        self._engine_mode = check_engine_mode(engine)
        kernel_below_bytes = check_int("kernel_below_bytes", kernel_below_bytes, minimum=0)
        block_size_factor = check_int("block_size_factor", block_size_factor, minimum=1)
        gpu_tensors = [t.tensor for t in kv_caches.tensors]
        if len(gpu_tensors) != len(cpu_tensors):
            raise ConfigError(
                f"{len(gpu_tensors)} GPU tensors but {len(cpu_tensors)} CPU tensors"
            )
        self.driver: CudaDriver = driver if driver is not None else load_driver()
        if isinstance(self.driver, RuntimeDriver):
            _check_devices(gpu_tensors, cpu_tensors, self.driver.device)
        self.gpu_to_cpu = gpu_to_cpu
        self.block_size_factor = block_size_factor
        self.kernel_below_bytes = kernel_below_bytes
        self._gpu_tensors = list(gpu_tensors)
        self._cpu_tensors = list(cpu_tensors)
        self._src_tensors = self._gpu_tensors if gpu_to_cpu else self._cpu_tensors
        self._dst_tensors = self._cpu_tensors if gpu_to_cpu else self._gpu_tensors
        self._planner = TransferPlanner(
            kv_caches.group_data_refs, self._src_tensors, self._dst_tensors, block_size_factor
        )
        self._coalesce = coalesce_copies
        self._producer = producer_stream
        self._lane = ("cuda", id(self), transfer_type)
        self._streams: HandlePool = stream_pool(self.driver)
        self._events: HandlePool = event_pool(self.driver, timing=False)
        self._timing_events: HandlePool | None = (
            event_pool(self.driver, timing=True) if timing else None
        )
        self._dma = DmaEngine(self.driver)
        self._kernel: KernelEngine | None = None
        self._pointer_offset = 0
        self.kernel_unavailable_reason: str | None = None
        if self._engine_mode != "dma":
            self._setup_kernel()
        self._last_end: int | None = None
        self._in_flight: dict[int, _Transfer] = {}
        # Transfers whose handles a waiter thread still holds (returned by that
        # thread once it leaves cudaEventSynchronize); close waits for them.
        self._held_by_waiters = 0
        self._held_lock = threading.Lock()
        self.engine_counts: dict[EngineName, int] = {"dma": 0, "kernel": 0}

    # ---------------------------------------------------------------- setup
    def _setup_kernel(self) -> None:
        """Compile the kernel and check CPU memory is device-mapped, or say why not."""
        kernel: KernelEngine | None = None
        try:
            offset = _device_pointer_offset(self.driver, self._cpu_tensors)
            kernel = KernelEngine(self.driver)
            stream = self._streams.acquire()
            try:
                kernel.smoke_test(stream)
            finally:
                self._streams.release(stream)
        except (CudaError, ConfigError) as exc:
            if kernel is not None:
                with contextlib.suppress(CudaError):
                    kernel.close()
            if self._engine_mode == "kernel":
                raise
            self.kernel_unavailable_reason = str(exc)
            return
        self._kernel = kernel
        self._pointer_offset = offset

    @property
    def kernel_ready(self) -> bool:
        return self._kernel is not None

    # ------------------------------------------------------------ submission
    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        plan = self._plan(spec)
        engine = choose_engine(
            plan,
            mode=self._engine_mode,
            kernel_below_bytes=self.kernel_below_bytes,
            kernel_ready=self._kernel is not None,
        )
        transfer = _Transfer()
        transfer.plan = plan
        transfer.engine = engine
        try:
            self._enqueue(transfer)
        except BaseException:
            self._abandon(transfer)
            raise
        assert transfer.end is not None
        self._last_end = transfer.end
        self._in_flight[job_id] = transfer
        self.engine_counts[engine] += 1
        source = CudaEvent(self.driver, transfer.end)
        transfer.source = source
        return Submission(
            source=source,
            transfer_size=plan.total_bytes,
            lane=self._lane,
            elapsed=self._elapsed_for(transfer),
            release=lambda: self._release_transfer(job_id, transfer),
        )

    def _plan(self, spec: TransferSpec) -> PointerPlan:
        plan = self._planner.plan(self._check_route(spec)).pointers()
        return coalesce(plan) if self._coalesce else plan

    def _enqueue(self, transfer: _Transfer) -> None:
        driver = self.driver
        assert transfer.plan is not None
        # Host-side preparation first, so the timing events bracket device work only.
        batch: DmaBatch | None = None
        if transfer.engine == "kernel":
            assert self._kernel is not None
            transfer.descriptors = self._kernel.prepare(
                transfer.plan, gpu_to_cpu=self.gpu_to_cpu, pointer_offset=self._pointer_offset
            )
        else:
            batch = self._dma.prepare(transfer.plan)
        stream = transfer.stream = self._streams.acquire()
        transfer.end = self._events.acquire()
        if self._timing_events is not None:
            transfer.timing.append(self._timing_events.acquire())
            transfer.timing.append(self._timing_events.acquire())
        # Both directions order after the compute stream, captured here, on the
        # submitting thread (torch's current stream is per thread): a store must
        # not read KV still being written, a load must not be overwritten by
        # work queued before it (vLLM zeroes new blocks on that stream).
        transfer.producer_event = self._events.acquire()
        driver.event_record(transfer.producer_event, self._producer_stream())
        driver.stream_wait_event(stream, transfer.producer_event)
        if self._last_end is not None:
            driver.stream_wait_event(stream, self._last_end)
        if transfer.timing:
            driver.event_record(transfer.timing[0], stream)
        if batch is None:
            assert self._kernel is not None
            self._kernel.enqueue(stream, transfer.descriptors)
        else:
            self._dma.enqueue(stream, batch, gpu_to_cpu=self.gpu_to_cpu)
        if transfer.timing:
            driver.event_record(transfer.timing[1], stream)
        driver.event_record(transfer.end, stream)

    def _producer_stream(self) -> int:
        producer = self._producer
        if producer is None:
            return self.driver.current_stream()
        if callable(producer):
            return int(producer())
        return int(producer)

    def _abandon(self, transfer: _Transfer) -> None:
        """Undo a submission that failed part-way: nothing may stay enqueued or leak."""
        clean = True
        if transfer.stream is not None:
            try:
                self.driver.stream_synchronize(transfer.stream)
            except CudaError:
                clean = False
        self._return(transfer, clean=clean)

    def _elapsed_for(self, transfer: _Transfer) -> Callable[[], float | None] | None:
        if not transfer.timing:
            return None
        start, stop = transfer.timing
        return lambda: self.driver.event_elapsed_ms(start, stop) * 1e-3

    # -------------------------------------------------------------- completion
    def _release_transfer(self, job_id: int, transfer: _Transfer) -> None:
        self._in_flight.pop(job_id, None)
        clean = True
        source = transfer.source
        if source is not None and not source.completed:
            # The copy failed (its stream and events are in an unknown state:
            # destroy them rather than reuse them), or the poller never took
            # the source (wait, so nothing still reads our buffers).
            try:
                source.synchronize()
            except CudaError:
                clean = False
        if transfer.end is not None and transfer.end == self._last_end:
            self._last_end = None
        with self._held_lock:
            self._held_by_waiters += 1
        if source is not None and source.after_waiters(
            lambda: self._return_from_waiter(transfer, clean=clean)
        ):
            return  # a waiter thread is still inside cudaEventSynchronize on ``end``
        with self._held_lock:
            self._held_by_waiters -= 1
        self._return(transfer, clean=clean)

    def _return_from_waiter(self, transfer: _Transfer, *, clean: bool) -> None:
        """:meth:`_return` on the last waiter thread, which has nobody to raise to."""
        try:
            self._return(transfer, clean=clean)
        except (CudaError, KeyError):
            logger.exception("returning the CUDA handles of a finished transfer failed")
        finally:
            with self._held_lock:
                self._held_by_waiters -= 1

    def _return(self, transfer: _Transfer, *, clean: bool) -> None:
        """Hand a transfer's pooled objects back (or destroy them if their state is unknown)."""
        errors: list[BaseException] = []

        def give(pool: HandlePool, handle: int | None) -> None:
            if handle is None:
                return
            try:
                if clean:
                    pool.release(handle)
                else:
                    pool.discard(handle)
            except (CudaError, KeyError) as exc:
                errors.append(exc)

        give(self._streams, transfer.stream)
        give(self._events, transfer.end)
        give(self._events, transfer.producer_event)
        if self._timing_events is not None:
            for handle in transfer.timing:
                give(self._timing_events, handle)
        if transfer.descriptors is not None and self._kernel is not None:
            try:
                self._kernel.release(transfer.descriptors)
            except CudaError as exc:
                errors.append(exc)
        transfer.stream = transfer.end = transfer.producer_event = None
        transfer.timing = []
        transfer.descriptors = None
        transfer.plan = None
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ close
    async def _close_backend(self) -> None:
        # A transfer can be reported (the loop's fallback poll saw its event done)
        # while a waiter thread is still inside cudaEventSynchronize on it; that
        # thread returns the handles when it leaves. Closing the pools first would
        # leave those handles undestroyed: wait for it (it is leaving a call on a
        # completed event), for a bounded time.
        deadline = time.monotonic() + _WAITER_RETURN_TIMEOUT
        while self._held_by_waiters and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        if self._held_by_waiters:
            logger.error(
                "closing %r while %d transfers' CUDA handles are still held by waiter threads",
                self, self._held_by_waiters,
            )
        errors: list[BaseException] = []
        for close in (
            self._streams.close,
            self._events.close,
            *((self._timing_events.close,) if self._timing_events is not None else ()),
            *((self._kernel.close,) if self._kernel is not None else ()),
        ):
            try:
                close()
            except CudaError as exc:
                errors.append(exc)
        self._gpu_tensors.clear()
        self._cpu_tensors.clear()
        if errors:
            raise errors[0]

    def in_flight_refs(self) -> list[weakref.ref[_Transfer]]:
        """Weak references to the in-flight transfers' records (for leak checks)."""
        return [weakref.ref(t) for t in self._in_flight.values()]


def _check_devices(
    gpu_tensors: Sequence[TensorLike], cpu_tensors: Sequence[TensorLike], device: int
) -> None:
    import torch

    for i, tensor in enumerate(gpu_tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            raise ConfigError(f"gpu_tensors[{i}] must be a CUDA tensor, got {_where(tensor)}")
        if tensor.device.index not in (None, device):
            raise ConfigError(
                f"gpu_tensors[{i}] is on cuda:{tensor.device.index}, the driver on cuda:{device}"
            )
    for i, tensor in enumerate(cpu_tensors):
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
            raise ConfigError(f"cpu_tensors[{i}] must be a CPU tensor, got {_where(tensor)}")


def _where(tensor: object) -> str:
    device = getattr(tensor, "device", None)
    return f"{type(tensor).__name__} on {device}" if device is not None else type(tensor).__name__


def _device_pointer_offset(driver: CudaDriver, cpu_tensors: Sequence[TensorLike]) -> int:
    """The one offset from host to device addresses valid for every CPU byte.

    The kernel reads CPU memory through its mapping; that needs pinned,
    mapped memory and a single offset (0 under UVA) so one addition
    translates any pointer. Raises ConfigError/CudaError otherwise.
    """
    offsets: set[int] = set()
    for tensor in cpu_tensors:
        space = RowSpace.of(tensor)
        if space.num_rows == 0:
            continue
        first, last = space.base_ptr, space.end_ptr - 1
        offsets.add(driver.host_device_pointer(first) - first)
        offsets.add(driver.host_device_pointer(last) - last)
    if len(offsets) > 1:
        raise ConfigError(
            f"CPU tensors map to the device at different offsets {sorted(offsets)}; "
            "the copy kernel needs one (use engine='dma')"
        )
    return offsets.pop() if offsets else 0
