"""The one module that calls cuda-python.

Everything above it speaks :class:`CudaDriver`, a narrow protocol over
plain integer handles, so a fake (:mod:`aiokvo.device.fake`) can
stand in for the GPU in CPU tests. Every raw call's status is checked and
turned into :class:`aiokvo.errors.CudaError` carrying the call, the error's
name and its number. ``cuda.bindings`` and ``cuda.core`` are imported
lazily, so importing this module never needs a GPU or even cuda-python.

Both the CUDA 12.x and 13.x bindings are handled: they differ in what
``cudaMemcpyBatchAsync`` returns (12.x also returns the failing index).
``cuda.core`` >= 0.2 is needed for the copy kernel (``launch(stream, config,
kernel, *args)`` and ``ProgramOptions``); it is found in ``cuda.core`` or, in
older releases, ``cuda.core.experimental``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from aiokvo.errors import CudaError, CudaUnavailableError

__all__ = [
    "CudaDriver",
    "RuntimeDriver",
    "cuda_device_count",
    "load_driver",
]

_SUCCESS = 0
_NOT_READY = 600  # cudaErrorNotReady
_NOT_SUPPORTED = 801  # cudaErrorNotSupported
_NEWER_DRIVER = 36  # cudaErrorCallRequiresNewerDriver
_BATCH_MIN_VERSION = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8


@runtime_checkable
class CudaDriver(Protocol):
    """The CUDA operations the backend needs, over integer handles.

    Streams, events and pointers are plain ``int``. Every method raises
    :class:`CudaError` on failure, except :meth:`device_count`.
    """

    device: int

    def device_count(self) -> int:
        """Number of visible devices; 0 (never an exception) without a driver."""
        ...

    def device_arch(self) -> str:
        """Compute capability as NVRTC spells it without a prefix, e.g. ``"90"``."""
        ...

    def sm_count(self) -> int: ...

    def has_memcpy_batch(self) -> bool:
        """Whether :meth:`memcpy_batch_async` is a single driver call here."""
        ...

    def stream_create(self) -> int: ...

    def stream_destroy(self, stream: int) -> None: ...

    def stream_synchronize(self, stream: int) -> None: ...

    def stream_wait_event(self, stream: int, event: int) -> None: ...

    def current_stream(self) -> int:
        """The stream the caller's framework (torch) computes on right now."""
        ...

    def event_create(self, *, timing: bool) -> int:
        """A blocking-sync event; ``timing=False`` also disables timing."""
        ...

    def event_destroy(self, event: int) -> None: ...

    def event_record(self, event: int, stream: int) -> None: ...

    def event_query(self, event: int) -> bool:
        """True once complete, False while pending; raises if the work failed."""
        ...

    def event_synchronize(self, event: int) -> None: ...

    def event_elapsed_ms(self, start: int, end: int) -> float: ...

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def memcpy_batch_async(
        self,
        dsts: Sequence[int],
        srcs: Sequence[int],
        sizes: Sequence[int],
        stream: int,
        *,
        src_in_stream_order: bool,
    ) -> None:
        """Enqueue many copies as one batch (or a loop where batching is missing)."""
        ...

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin (portable, mapped) ``nbytes`` of host memory at ``ptr``."""
        ...

    def host_unregister(self, ptr: int) -> None: ...

    def host_device_pointer(self, ptr: int) -> int:
        """The device-side address of pinned, mapped host memory at ``ptr``."""
        ...

    def host_alloc(self, nbytes: int) -> int:
        """Allocate pinned, mapped host memory (for kernel descriptors)."""
        ...

    def host_free(self, ptr: int) -> None: ...

    def compile_kernel(self, source: str, name: str, arch: str) -> object:
        """Compile CUDA C ``source`` for ``arch`` and return kernel ``name``."""
        ...

    def launch_kernel(
        self, kernel: object, stream: int, grid: int, block: int, args: Sequence[int]
    ) -> None:
        """Launch ``kernel`` with 64-bit unsigned integer ``args`` on ``stream``."""
        ...


def cuda_device_count() -> int:
    """Probe for CUDA devices without raising: 0 without cuda-python or a driver."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return 0
    try:
        err, count = runtime.cudaGetDeviceCount()
    except Exception:  # a broken install must read as "no device", not crash
        return 0
    return int(count) if int(err) == _SUCCESS and count is not None else 0


_drivers: dict[int, RuntimeDriver] = {}
_drivers_lock = threading.Lock()


def load_driver(device: int = 0) -> RuntimeDriver:
    """The real driver for ``device`` (one per process and device, so compiled
    kernels are shared), or :class:`CudaUnavailableError` saying why not."""
    with _drivers_lock:
        existing = _drivers.get(device)
        if existing is None:
            existing = _drivers[device] = _load_driver(device)
        return existing


def _load_driver(device: int) -> RuntimeDriver:
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise CudaUnavailableError(
            "cuda-python (cuda.bindings) is not installed, so the CUDA backend cannot start"
        ) from exc
    err, count = runtime.cudaGetDeviceCount()
    if int(err) != _SUCCESS:
        name = _error_name(runtime, err)
        raise CudaUnavailableError(
            f"no usable CUDA driver: cudaGetDeviceCount failed with {name} ({int(err)})"
        )
    if device < 0 or device >= int(count):
        raise CudaUnavailableError(f"CUDA device {device} requested but {int(count)} visible")
    return RuntimeDriver(device)


def _error_name(runtime: Any, err: Any) -> str:
    try:
        status, name = runtime.cudaGetErrorName(err)
    except Exception:
        return f"cudaError({int(err)})"
    if int(status) != _SUCCESS or name is None:
        return f"cudaError({int(err)})"
    return name.decode() if isinstance(name, bytes) else str(name)


class RuntimeDriver:
    """:class:`CudaDriver` over ``cuda.bindings.runtime``, bound to one device."""

    def __init__(self, device: int = 0) -> None:
        from cuda.bindings import runtime

        self._rt: Any = runtime
        self.device = device
        self._kernel_lock = threading.Lock()
        self._stream_wrappers: dict[int, Any] = {}
        self._check("cudaSetDevice", runtime.cudaSetDevice(device))
        driver_version = self._check("cudaDriverGetVersion", runtime.cudaDriverGetVersion())
        runtime_version = self._check("cudaRuntimeGetVersion", runtime.cudaRuntimeGetVersion())
        self.driver_version = int(driver_version)
        self.runtime_version = int(runtime_version)
        self._batch_ok = (
            hasattr(runtime, "cudaMemcpyBatchAsync")
            and min(self.driver_version, self.runtime_version) >= _BATCH_MIN_VERSION
        )
        self._batch_attrs: dict[bool, Any] = {}

    # -- error handling -------------------------------------------------

    def _check(self, call: str, result: Any) -> Any:
        """Raise :class:`CudaError` unless ``result``'s status is success.

        cuda-python returns ``(status,)`` or ``(status, value, ...)``; this
        returns ``None``, the single value, or the tuple of values.
        """
        if not isinstance(result, tuple):
            result = (result,)
        status = int(result[0])
        if status != _SUCCESS:
            raise CudaError(call, _error_name(self._rt, result[0]), status)
        values = result[1:]
        if not values:
            return None
        return values[0] if len(values) == 1 else values

    def _set_device(self) -> None:
        self._check("cudaSetDevice", self._rt.cudaSetDevice(self.device))

    # -- device ---------------------------------------------------------

    def device_count(self) -> int:
        return cuda_device_count()

    def _attribute(self, attr: Any) -> int:
        result = self._rt.cudaDeviceGetAttribute(attr, self.device)
        return int(self._check("cudaDeviceGetAttribute", result))

    def device_arch(self) -> str:
        attr = self._rt.cudaDeviceAttr
        major = self._attribute(attr.cudaDevAttrComputeCapabilityMajor)
        minor = self._attribute(attr.cudaDevAttrComputeCapabilityMinor)
        return f"{major}{minor}"

    def sm_count(self) -> int:
        return self._attribute(self._rt.cudaDeviceAttr.cudaDevAttrMultiProcessorCount)

    def has_memcpy_batch(self) -> bool:
        return self._batch_ok

    # -- streams --------------------------------------------------------

    def stream_create(self) -> int:
        self._set_device()
        stream = self._check(
            "cudaStreamCreateWithFlags",
            self._rt.cudaStreamCreateWithFlags(self._rt.cudaStreamNonBlocking),
        )
        return int(stream)

    def stream_destroy(self, stream: int) -> None:
        self._stream_wrappers.pop(stream, None)
        self._check("cudaStreamDestroy", self._rt.cudaStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("cudaStreamSynchronize", self._rt.cudaStreamSynchronize(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cudaStreamWaitEvent", self._rt.cudaStreamWaitEvent(stream, event, 0))

    def current_stream(self) -> int:
        import torch

        return int(torch.cuda.current_stream(self.device).cuda_stream)

    # -- events ---------------------------------------------------------

    def event_create(self, *, timing: bool) -> int:
        self._set_device()
        flags = self._rt.cudaEventBlockingSync
        if not timing:
            flags |= self._rt.cudaEventDisableTiming
        return int(
            self._check("cudaEventCreateWithFlags", self._rt.cudaEventCreateWithFlags(flags))
        )

    def event_destroy(self, event: int) -> None:
        self._check("cudaEventDestroy", self._rt.cudaEventDestroy(event))

    def event_record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self._rt.cudaEventRecord(event, stream))

    def event_query(self, event: int) -> bool:
        result = self._rt.cudaEventQuery(event)
        if int(result[0]) == _NOT_READY:
            return False
        self._check("cudaEventQuery", result)
        return True

    def event_synchronize(self, event: int) -> None:
        self._check("cudaEventSynchronize", self._rt.cudaEventSynchronize(event))

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(
            self._check("cudaEventElapsedTime", self._rt.cudaEventElapsedTime(start, end))
        )

    # -- copies ---------------------------------------------------------

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDefault
        self._check(
            "cudaMemcpyAsync", self._rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream)
        )

    def _attrs(self, src_in_stream_order: bool) -> Any:
        attrs = self._batch_attrs.get(src_in_stream_order)
        if attrs is None:
            order = self._rt.cudaMemcpySrcAccessOrder
            attrs = self._rt.cudaMemcpyAttributes()
            attrs.srcAccessOrder = (
                order.cudaMemcpySrcAccessOrderStream
                if src_in_stream_order
                else order.cudaMemcpySrcAccessOrderAny
            )
            # Ask for copy engines, so offloading overlaps the model's kernels.
            flags = getattr(self._rt, "cudaMemcpyFlags", None)
            overlap = getattr(flags, "cudaMemcpyFlagPreferOverlapWithCompute", 0)
            attrs.flags = int(overlap)
            self._batch_attrs[src_in_stream_order] = attrs
        return attrs

    def memcpy_batch_async(
        self,
        dsts: Sequence[int],
        srcs: Sequence[int],
        sizes: Sequence[int],
        stream: int,
        *,
        src_in_stream_order: bool,
    ) -> None:
        count = len(sizes)
        if count == 0:
            return
        if len(dsts) != count or len(srcs) != count:
            raise ValueError(f"batch lengths differ: {len(dsts)}, {len(srcs)}, {count}")
        if self._batch_ok:
            attrs = self._attrs(src_in_stream_order)
            # 12.x returns (status, failIdx); 13.x returns (status,): _check takes both.
            try:
                result = self._rt.cudaMemcpyBatchAsync(
                    list(dsts), list(srcs), list(sizes), count, [attrs], [0], 1, stream
                )
            except TypeError:  # a binding whose signature differs: nothing was enqueued
                result = (_NOT_SUPPORTED,)
            status = int(result[0])
            if status not in (_NOT_SUPPORTED, _NEWER_DRIVER):
                self._check("cudaMemcpyBatchAsync", result)
                return
            self._batch_ok = False  # this driver/binding lacks it: loop from now on
        for dst, src, nbytes in zip(dsts, srcs, sizes, strict=True):
            self.memcpy_async(int(dst), int(src), int(nbytes), stream)

    # -- pinned host memory ---------------------------------------------

    def host_register(self, ptr: int, nbytes: int) -> None:
        flags = self._rt.cudaHostRegisterPortable | self._rt.cudaHostRegisterMapped
        self._set_device()
        self._check("cudaHostRegister", self._rt.cudaHostRegister(ptr, nbytes, flags))

    def host_unregister(self, ptr: int) -> None:
        self._check("cudaHostUnregister", self._rt.cudaHostUnregister(ptr))

    def host_device_pointer(self, ptr: int) -> int:
        return int(
            self._check("cudaHostGetDevicePointer", self._rt.cudaHostGetDevicePointer(ptr, 0))
        )

    def host_alloc(self, nbytes: int) -> int:
        flags = self._rt.cudaHostAllocPortable | self._rt.cudaHostAllocMapped
        self._set_device()
        return int(self._check("cudaHostAlloc", self._rt.cudaHostAlloc(nbytes, flags)))

    def host_free(self, ptr: int) -> None:
        self._check("cudaFreeHost", self._rt.cudaFreeHost(ptr))

    # -- kernels (NVRTC through cuda.core) ------------------------------

    def compile_kernel(self, source: str, name: str, arch: str) -> object:
        core = _import_cuda_core()
        with self._kernel_lock:
            core.Device(self.device).set_current()
            options = core.ProgramOptions(arch=f"sm_{arch}", std="c++17")
            try:
                program = core.Program(source, code_type="c++", options=options)
                module = program.compile("cubin")
            except Exception as exc:  # NVRTC missing or the source is rejected
                raise CudaError("nvrtcCompileProgram", type(exc).__name__, -1, str(exc)) from exc
            try:
                return module.get_kernel(name)
            except Exception as exc:  # the driver cannot load this cubin
                raise CudaError("cuLibraryLoadData", type(exc).__name__, -1, str(exc)) from exc

    def _wrap_stream(self, core: Any, stream: int) -> Any:
        wrapper = self._stream_wrappers.get(stream)
        if wrapper is None:
            from_handle = getattr(core.Stream, "from_handle", None)
            wrapper = from_handle(stream) if from_handle is not None else _ForeignStream(stream)
            self._stream_wrappers[stream] = wrapper
        return wrapper

    def launch_kernel(
        self, kernel: object, stream: int, grid: int, block: int, args: Sequence[int]
    ) -> None:
        import numpy as np

        core = _import_cuda_core()
        config = core.LaunchConfig(grid=grid, block=block)
        params = [np.uint64(a) for a in args]
        try:
            core.launch(self._wrap_stream(core, stream), config, kernel, *params)
        except Exception as exc:
            raise CudaError("cuLaunchKernel", type(exc).__name__, -1, str(exc)) from exc


class _ForeignStream:
    """A raw stream handle in the ``__cuda_stream__`` protocol (cuda.core >= 0.2)."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def _import_cuda_core() -> Any:
    try:
        import cuda.core as core

        if hasattr(core, "Program"):
            return core
    except ImportError:
        pass
    try:
        from cuda.core import experimental as legacy
    except ImportError as exc:
        raise CudaUnavailableError(
            "cuda.core is not installed, so the copy kernel cannot be compiled"
        ) from exc
    return legacy
