"""A stand-in for :class:`~aiokvo.device.driver.RuntimeDriver` on the CPU.

Streams are worker threads that run their operations in order, events are
generation counters, and "device" pointers are host pointers, so copies are
``memmove``. That is enough to run the CUDA handler's ordering, pooling,
lifetime and error logic in CPU tests. Failures can be injected at a call
(:meth:`FakeDriver.fail_call`, raised synchronously like a bad argument)
or at completion (:meth:`FakeDriver.fail_next_op`, surfaced by every later
event recorded on that stream, like CUDA's sticky asynchronous errors).
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from aiokvo.errors import CudaError

__all__ = ["FakeDriver", "FakeKernel"]

_Op = Callable[[], None]

_LAUNCH_FAILURE = ("cudaErrorLaunchFailure", 719)
_ERROR_CODES = {
    "cudaErrorInvalidValue": 1,
    "cudaErrorMemoryAllocation": 2,
    "cudaErrorInvalidResourceHandle": 400,
    "cudaErrorLaunchFailure": 719,
    "cudaErrorHostMemoryAlreadyRegistered": 712,
    "cudaErrorHostMemoryNotRegistered": 713,
}


_PAGE = 4096


def _page_floor(address: int) -> int:
    return address - address % _PAGE


def _page_ceil(address: int) -> int:
    return -(-address // _PAGE) * _PAGE


@dataclass(frozen=True, slots=True)
class FakeKernel:
    """What :meth:`FakeDriver.compile_kernel` returns: a named host routine."""

    name: str
    arch: str


class _FakeEvent:
    __slots__ = ("done", "error", "recorded", "timestamps", "timing", "waiters")

    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self.recorded = 0  # generations recorded so far
        self.done = 0  # generations whose marker has run
        self.waiters = 0  # threads inside event_synchronize on it
        self.error: CudaError | None = None
        self.timestamps: dict[int, float] = {}


class _FakeStream:
    """One worker thread running this stream's operations in order."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self.error: CudaError | None = None  # set by a failed op; every later event fails
        self.thread = threading.Thread(target=self._run, name=f"fake-stream-{handle}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            op = self.ops.get()
            if op is None:
                return
            try:
                op()
            except Exception as exc:
                # A dead thread would leave every later event unfired (a hang);
                # like a faulting kernel, the failure is sticky instead.
                self.error = self.error or CudaError(
                    "cudaStreamSynchronize", *_LAUNCH_FAILURE, f"fake stream op raised {exc!r}"
                )


class FakeDriver:
    """Host-memory fake of the CUDA driver protocol (see the module docstring)."""

    def __init__(self, *, has_batch: bool = True, arch: str = "90", sms: int = 4) -> None:
        self.device = 0
        self._has_batch = has_batch
        self._arch = arch
        self._sms = sms
        self._ids = itertools.count(0x1000, 0x10)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._streams: dict[int, _FakeStream] = {}
        self._events: dict[int, _FakeEvent] = {}
        self._registered: dict[int, int] = {}  # base -> nbytes
        self._allocations: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self._call_failures: dict[str, list[CudaError]] = {}
        self.calls: Counter[str] = Counter()
        self.kernels_compiled: Counter[str] = Counter()
        # Like torch's: one default stream, and a current stream per thread.
        self._default_stream: int | None = None
        self._current = threading.local()
        self._pending_gate: threading.Event | None = None
        self._pending_failure: CudaError | None = None
        self._sync_gate: threading.Event | None = None
        # The real driver crashes the process when an event is destroyed while
        # a thread is inside cudaEventSynchronize on it; the fake counts it.
        self.destroyed_while_waited = 0
        self.gate_timeout = 30.0  # a test that fails before opening a gate must not hang
        self._clock = itertools.count(1)

    # -- test controls --------------------------------------------------

    def fail_call(self, call: str, name: str = "cudaErrorInvalidValue", *, times: int = 1) -> None:
        """Make the next ``times`` calls of method ``call`` raise ``CudaError``."""
        code = _ERROR_CODES.get(name, 999)
        errors = [CudaError(call, name, code, "injected by FakeDriver") for _ in range(times)]
        with self._lock:
            self._call_failures.setdefault(call, []).extend(errors)

    def fail_next_op(self) -> None:
        """Make the next copy or launch enqueued fail when it runs (an async launch failure)."""
        self._pending_failure = CudaError(
            "cudaEventSynchronize", *_LAUNCH_FAILURE, "injected by FakeDriver"
        )

    def gate_next_op(self) -> threading.Event:
        """Make the next copy or launch enqueued (on any stream) wait for the returned event."""
        gate = threading.Event()
        self._pending_gate = gate
        return gate

    def hold_next_synchronize(self) -> threading.Event:
        """Keep the next ``event_synchronize`` inside the call, after its event
        completed, until the returned event is set (a waiter thread that is
        slow to come back out of the driver)."""
        gate = threading.Event()
        self._sync_gate = gate
        return gate

    def enqueue_host(self, stream: int, fn: _Op) -> None:
        """Run ``fn`` on ``stream``'s thread, in order with its other work."""
        self._stream(stream).ops.put(fn)

    def hold(self, stream: int) -> threading.Event:
        """Block ``stream`` until the returned event is set."""
        gate = threading.Event()

        def wait() -> None:
            gate.wait(self.gate_timeout)

        self.enqueue_host(stream, wait)
        return gate

    @property
    def live_streams(self) -> int:
        return len(self._streams)

    @property
    def live_events(self) -> int:
        return len(self._events)

    @property
    def live_host_allocations(self) -> int:
        return len(self._allocations)

    @property
    def registered(self) -> dict[int, int]:
        return dict(self._registered)

    def close(self) -> None:
        """Stop every stream thread (tests call this after the handler closed)."""
        for stream in list(self._streams.values()):
            stream.ops.put(None)
            stream.thread.join(timeout=5)
        self._streams.clear()

    # -- helpers --------------------------------------------------------

    def _enter(self, call: str) -> None:
        # Waiter threads call in too (event_query, event_synchronize), so the
        # count and the injected failure are taken atomically.
        with self._lock:
            self.calls[call] += 1
            pending = self._call_failures.get(call)
            error = pending.pop(0) if pending else None
        if error is not None:
            raise error

    def _stream(self, handle: int) -> _FakeStream:
        stream = self._streams.get(handle)
        if stream is None:
            raise CudaError("stream", "cudaErrorInvalidResourceHandle", 400, f"stream {handle}")
        return stream

    def _event(self, handle: int) -> _FakeEvent:
        event = self._events.get(handle)
        if event is None:
            raise CudaError("event", "cudaErrorInvalidResourceHandle", 400, f"event {handle}")
        return event

    def _device_op(self, stream: _FakeStream, work: _Op) -> None:
        """Enqueue work that an injected completion failure can replace."""
        gate, self._pending_gate = self._pending_gate, None
        failure, self._pending_failure = self._pending_failure, None

        def run() -> None:
            if gate is not None:
                gate.wait(self.gate_timeout)
            if failure is not None:
                stream.error = failure
                return
            work()

        stream.ops.put(run)

    # -- device ---------------------------------------------------------

    def device_count(self) -> int:
        return 1

    def device_arch(self) -> str:
        return self._arch

    def sm_count(self) -> int:
        return self._sms

    def has_memcpy_batch(self) -> bool:
        return self._has_batch

    # -- streams --------------------------------------------------------

    def stream_create(self) -> int:
        self._enter("stream_create")
        handle = next(self._ids)
        self._streams[handle] = _FakeStream(handle)
        return handle

    def stream_destroy(self, stream: int) -> None:
        self._enter("stream_destroy")
        target = self._streams.pop(stream, None)
        if target is None:
            raise CudaError("cudaStreamDestroy", "cudaErrorInvalidResourceHandle", 400)
        target.ops.put(None)  # drains queued work first, like cudaStreamDestroy

    def stream_synchronize(self, stream: int) -> None:
        self._enter("stream_synchronize")
        done = threading.Event()
        self._stream(stream).ops.put(done.set)
        done.wait()

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._enter("stream_wait_event")
        target = self._event(event)
        with self._cond:
            generation = target.recorded

        def wait() -> None:
            with self._cond:
                self._cond.wait_for(lambda: target.done >= generation)

        self._stream(stream).ops.put(wait)

    def current_stream(self) -> int:
        """The calling thread's current stream (torch keeps one per thread);
        threads that never set one share a default stream."""
        stream: int | None = getattr(self._current, "stream", None)
        if stream is not None:
            return stream
        if self._default_stream is None:
            self._default_stream = self.stream_create()
        return self._default_stream

    def set_current_stream(self, stream: int | None) -> None:
        """Make ``stream`` the calling thread's current stream (None: the default)."""
        self._current.stream = stream

    # -- events ---------------------------------------------------------

    def event_create(self, *, timing: bool) -> int:
        self._enter("event_create")
        handle = next(self._ids)
        self._events[handle] = _FakeEvent(timing)
        return handle

    def event_destroy(self, event: int) -> None:
        self._enter("event_destroy")
        with self._cond:
            target = self._events.pop(event, None)
            if target is not None and target.waiters:
                self.destroyed_while_waited += 1
        if target is None:
            raise CudaError("cudaEventDestroy", "cudaErrorInvalidResourceHandle", 400)

    def event_record(self, event: int, stream: int) -> None:
        self._enter("event_record")
        target = self._event(event)
        owner = self._stream(stream)
        with self._cond:
            target.recorded += 1
            generation = target.recorded

        def mark() -> None:
            with self._cond:
                target.error = owner.error  # sticky, like CUDA's asynchronous errors
                target.timestamps[generation] = float(next(self._clock))
                target.done = generation
                self._cond.notify_all()

        owner.ops.put(mark)

    def event_query(self, event: int) -> bool:
        self._enter("event_query")
        target = self._event(event)
        with self._cond:
            if target.done < target.recorded:
                return False
            if target.error is not None:
                raise target.error
        return True

    def event_synchronize(self, event: int) -> None:
        self._enter("event_synchronize")
        target = self._event(event)
        with self._cond:
            target.waiters += 1
            generation = target.recorded
            self._cond.wait_for(lambda: target.done >= generation)
            error = target.error
            gate, self._sync_gate = self._sync_gate, None
        try:
            if gate is not None:
                gate.wait(self.gate_timeout)
        finally:
            with self._cond:
                target.waiters -= 1
        if error is not None:
            raise error

    def event_elapsed_ms(self, start: int, end: int) -> float:
        self._enter("event_elapsed_ms")
        first, last = self._event(start), self._event(end)
        if not (first.timing and last.timing):
            raise CudaError("cudaEventElapsedTime", "cudaErrorInvalidResourceHandle", 400)
        return (last.timestamps[last.done] - first.timestamps[first.done]) * 1e-3

    # -- copies ---------------------------------------------------------

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._enter("memcpy_async")
        def copy() -> None:
            ctypes.memmove(dst, src, nbytes)

        self._device_op(self._stream(stream), copy)

    def memcpy_batch_async(
        self,
        dsts: Sequence[int],
        srcs: Sequence[int],
        sizes: Sequence[int],
        stream: int,
        *,
        src_in_stream_order: bool,
    ) -> None:
        if not self._has_batch:
            for dst, src, nbytes in zip(dsts, srcs, sizes, strict=True):
                self.memcpy_async(int(dst), int(src), int(nbytes), stream)
            return
        self._enter("memcpy_batch_async")
        triples = [(int(d), int(s), int(n)) for d, s, n in zip(dsts, srcs, sizes, strict=True)]

        def copy_all() -> None:
            for dst, src, nbytes in triples:
                ctypes.memmove(dst, src, nbytes)

        self._device_op(self._stream(stream), copy_all)

    # -- pinned host memory ---------------------------------------------

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._enter("host_register")
        # CUDA pins whole pages: ranges that share a page collide.
        lo, hi = _page_floor(ptr), _page_ceil(ptr + nbytes)
        for base, size in self._registered.items():
            if lo < _page_ceil(base + size) and _page_floor(base) < hi:
                raise CudaError("cudaHostRegister", "cudaErrorHostMemoryAlreadyRegistered", 712)
        self._registered[ptr] = nbytes

    def host_unregister(self, ptr: int) -> None:
        self._enter("host_unregister")
        if self._registered.pop(ptr, None) is None:
            raise CudaError("cudaHostUnregister", "cudaErrorHostMemoryNotRegistered", 713)

    def host_device_pointer(self, ptr: int) -> int:
        self._enter("host_device_pointer")
        for base, size in self._registered.items():
            if base <= ptr < base + size:
                return ptr
        for base, buffer in self._allocations.items():
            if base <= ptr < base + ctypes.sizeof(buffer):
                return ptr
        raise CudaError("cudaHostGetDevicePointer", "cudaErrorInvalidValue", 1, hex(ptr))

    def host_alloc(self, nbytes: int) -> int:
        self._enter("host_alloc")
        buffer = ctypes.create_string_buffer(max(nbytes, 1))
        address = ctypes.addressof(buffer)
        self._allocations[address] = buffer
        return address

    def host_free(self, ptr: int) -> None:
        self._enter("host_free")
        if self._allocations.pop(ptr, None) is None:
            raise CudaError("cudaFreeHost", "cudaErrorInvalidValue", 1, hex(ptr))

    # -- kernels --------------------------------------------------------

    def compile_kernel(self, source: str, name: str, arch: str) -> object:
        self._enter("compile_kernel")
        if f"void {name}(" not in source:
            raise CudaError("nvrtcCompileProgram", "NVRTC_ERROR_COMPILATION", 6, name)
        self.kernels_compiled[f"{name}@{arch}"] += 1
        return FakeKernel(name, arch)

    def launch_kernel(
        self, kernel: object, stream: int, grid: int, block: int, args: Sequence[int]
    ) -> None:
        self._enter("launch_kernel")
        if not isinstance(kernel, FakeKernel) or grid < 1 or block < 1:
            raise CudaError("cuLaunchKernel", "cudaErrorInvalidValue", 1, repr(kernel))
        descriptors, count = int(args[0]), int(args[1])

        def run_copy_kernel() -> None:
            # The descriptor layout of aiokvo.handlers.cuda.kernel: (src, dst, size) triples.
            if count == 0:
                return
            table = np.ctypeslib.as_array(
                (ctypes.c_uint64 * (3 * count)).from_address(descriptors)
            ).reshape(count, 3)
            for src, dst, nbytes in table.tolist():
                ctypes.memmove(dst, src, nbytes)

        self._device_op(self._stream(stream), run_copy_kernel)
