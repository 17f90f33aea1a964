"""The host backend: copies between CPU tensors on a worker thread.

Here the "GPU" KV caches are CPU tensors, so the backend runs on any machine;
it is what tests, CI and the demo use without a device. Each handler owns one
worker thread: copies of one direction run strictly in submission order, and
torch releases the GIL inside its kernels, so the event loop keeps running.

A transfer is validated and planned on the caller's thread
(:func:`~aiokvo.handlers.plan.plan_transfer`), so bad input raises from
``transfer_async`` before anything is enqueued. The worker then runs one
gather (``index_select``) and one scatter (``index_copy_``) per tensor, over
rows viewed with the widest element type the page size allows: never a
Python loop per page.

Fault injection: pass ``copy_fn`` to run something else on the worker thread
in place of :func:`apply_host_copies`. Whatever it raises fails that transfer
(``TransferResult.success`` is false and ``error`` is the exception).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from aiokvo.errors import LayoutError, TransferSpecError
from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.plan import Int64Array, RowSpace, plan_transfer
from aiokvo.handlers.task import DEFAULT_MAX_BUFFERED
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.poller import PollerMode
from aiokvo.runtime.sources import HostEvent
from aiokvo.specs import TransferSpec

__all__ = ["CopyFn", "GatherBuffer", "HostCopy", "HostOffloadingHandler", "apply_host_copies"]

# Widest first: fewer, larger elements make torch's index kernels much faster.
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8)


@dataclass(frozen=True, slots=True)
class HostCopy:
    """Copy rows ``src_rows`` of ``src`` into rows ``dst_rows`` of ``dst``.

    ``src`` and ``dst`` are 2-D views with equal row widths (any dtype);
    ``*_start`` is the first row when the rows form one ascending run (so
    a plain slice can replace an index), else ``None``.
    """

    src: torch.Tensor
    dst: torch.Tensor
    src_rows: torch.Tensor
    dst_rows: torch.Tensor
    src_start: int | None
    dst_start: int | None

    @property
    def nbytes(self) -> int:
        return int(self.src_rows.shape[0]) * self.src.shape[1] * self.src.element_size()


CopyFn = Callable[[Sequence[HostCopy]], None]
"""What the worker thread runs for one transfer (see :func:`apply_host_copies`)."""


def apply_host_copies(copies: Sequence[HostCopy], scratch: GatherBuffer | None = None) -> None:
    """Run ``copies`` in order: a gather into a scratch buffer, then a scatter.

    A side whose rows form one run is used as a slice, which saves the extra pass.
    """
    for copy in copies:
        n = int(copy.src_rows.shape[0])
        if n == 0:
            continue
        if copy.src_start is not None:
            gathered = copy.src.narrow(0, copy.src_start, n)
        elif copy.dst_start is not None and copy.dst.is_contiguous():
            torch.index_select(
                copy.src, 0, copy.src_rows, out=copy.dst.narrow(0, copy.dst_start, n)
            )
            continue
        else:
            buffer = scratch.get(n, copy.src) if scratch is not None else None
            gathered = torch.index_select(copy.src, 0, copy.src_rows, out=buffer)
        if copy.dst_start is not None:
            copy.dst.narrow(0, copy.dst_start, n).copy_(gathered)
        else:
            copy.dst.index_copy_(0, copy.dst_rows, gathered)


class GatherBuffer:
    """A reusable gather buffer, so a copy never pays for a fresh allocation."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.int8)

    def get(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        width = int(like.shape[1])
        nbytes = rows * width * like.element_size()
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.int8)
        return self._buffer[:nbytes].view(like.dtype).view(rows, width)


class HostOffloadingHandler(SingleDirectionHandler):
    """One direction between CPU-resident KV caches and a CPU block pool.

    ``cpu_tensors[i]`` is the pool for canonical tensor ``i`` of
    ``kv_caches``: shape ``(num_cpu_blocks, page_size_bytes * block_size_factor)``,
    int8, contiguous. ``gpu_to_cpu`` picks the direction (stores when true,
    loads when false). ``copy_fn`` replaces the copy for fault injection.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_tensors: Sequence[torch.Tensor],
        *,
        block_size_factor: int,
        gpu_to_cpu: bool,
        poller_mode: PollerMode | None = None,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        copy_fn: CopyFn | None = None,
    ) -> None:
        super().__init__(
            ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU"),
            poller_mode=poller_mode,
            max_buffered=max_buffered,
        )
        _check_pool(kv_caches, cpu_tensors, block_size_factor)
        self.kv_caches = kv_caches
        self.cpu_tensors: tuple[torch.Tensor, ...] = tuple(cpu_tensors)
        self.block_size_factor = block_size_factor
        self.gpu_to_cpu = gpu_to_cpu
        gpu = [t.tensor for t in kv_caches.tensors]
        cpu = list(self.cpu_tensors)
        src, dst = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
        self._src_spaces = tuple(RowSpace.of(t) for t in src)
        self._dst_spaces = tuple(RowSpace.of(t) for t in dst)
        self._src_tensors, self._dst_tensors = src, dst
        self._scratch = GatherBuffer()
        self._copy_fn: CopyFn = copy_fn or (lambda c: apply_host_copies(c, self._scratch))
        direction = "g2c" if gpu_to_cpu else "c2g"
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"aiokvo-host-{direction}"
        )
        self._lane = (type(self).__name__, direction, id(self))

    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        src_spec, dst_spec = _check_route(spec, self.transfer_type)
        plan = plan_transfer(
            (src_spec, dst_spec),
            self.kv_caches.group_data_refs,
            self._src_spaces,
            self._dst_spaces,
            self.block_size_factor,
        )
        copies = [
            _host_copy(
                self._src_tensors[c.tensor_idx],
                self._dst_tensors[c.tensor_idx],
                plan.src_factor,
                plan.dst_factor,
                c.nbytes,
                c.src_rows,
                c.dst_rows,
            )
            for c in plan.row_copies()
        ]
        event = HostEvent()
        timing = _Timing()
        copy_fn = self._copy_fn

        def run() -> None:
            timing.start = time.perf_counter()
            try:
                copy_fn(copies)
            except BaseException as exc:
                event.set_exception(exc)
            else:
                timing.end = time.perf_counter()
                event.set()

        self._pool.submit(run)
        return Submission(
            source=event, transfer_size=plan.total_bytes, lane=self._lane, elapsed=timing.elapsed
        )

    async def _close_backend(self) -> None:
        # Everything in flight has finished, so the worker is idle: joining is instant.
        self._pool.shutdown(wait=True)


class _Timing:
    """Copy start/end as seen by the worker thread (queueing time excluded)."""

    __slots__ = ("end", "start")

    def __init__(self) -> None:
        self.start = 0.0
        self.end = 0.0

    def elapsed(self) -> float | None:
        return self.end - self.start if self.end else None


def _check_route(spec: TransferSpec, transfer_type: tuple[str, str]) -> TransferSpec:
    try:
        src_spec, dst_spec = spec
    except (TypeError, ValueError):
        raise TransferSpecError(
            f"a transfer spec is a (src_spec, dst_spec) pair, got {spec!r}"
        ) from None
    route = (src_spec.medium(), dst_spec.medium())
    if route != transfer_type:
        raise TransferSpecError(
            f"this handler copies {transfer_type[0]} -> {transfer_type[1]}, "
            f"got a {route[0]} -> {route[1]} spec"
        )
    return src_spec, dst_spec


def _check_pool(
    kv_caches: CanonicalKVCaches, cpu_tensors: Sequence[torch.Tensor], factor: int
) -> None:
    if kv_caches.is_cuda or any(t.device.type != "cpu" for t in cpu_tensors):
        raise LayoutError("the host backend copies between CPU tensors only")
    if len(cpu_tensors) != len(kv_caches.tensors):
        raise LayoutError(
            f"{len(kv_caches.tensors)} KV tensors need as many CPU pools, got {len(cpu_tensors)}"
        )
    for i, (kv, cpu) in enumerate(zip(kv_caches.tensors, cpu_tensors, strict=True)):
        want = kv.page_size_bytes * factor
        if cpu.dtype != torch.int8 or cpu.ndim != 2 or not cpu.is_contiguous():
            raise LayoutError(
                f"CPU pool {i} must be a contiguous 2-D int8 tensor, "
                f"got {cpu.dtype} shape {tuple(cpu.shape)}"
            )
        if cpu.shape[1] != want:
            raise LayoutError(
                f"CPU pool {i} rows must be page_size_bytes {kv.page_size_bytes} x "
                f"block_size_factor {factor} = {want} bytes, got {cpu.shape[1]}"
            )


def _host_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_factor: int,
    dst_factor: int,
    nbytes: int,
    src_rows: Int64Array,
    dst_rows: Int64Array,
) -> HostCopy:
    src_view, dst_view = _widen(
        _sub_rows(src, src_factor, nbytes), _sub_rows(dst, dst_factor, nbytes)
    )
    return HostCopy(
        src_view,
        dst_view,
        torch.from_numpy(src_rows),
        torch.from_numpy(dst_rows),
        _run_start(src_rows),
        _run_start(dst_rows),
    )


def _sub_rows(tensor: torch.Tensor, factor: int, nbytes: int) -> torch.Tensor:
    """``tensor`` as ``(rows * factor, nbytes)``: sub-row ``k`` is a page's first bytes."""
    if factor > 1:
        rows, width = tensor.shape
        tensor = tensor.view(rows * factor, width // factor)
    return tensor[:, :nbytes]


def _widen(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for dtype in _WIDE_DTYPES:
        try:
            return src.view(dtype), dst.view(dtype)
        except RuntimeError:
            continue
    return src, dst  # pragma: no cover - int8 always works


def _run_start(rows: Int64Array) -> int | None:
    n = int(rows.shape[0])
    if n == 0:
        return None
    first = int(rows[0])
    if int(rows[-1]) - first != n - 1:
        return None
    if n > 2 and not bool(np.all(np.diff(rows) == 1)):
        return None
    return first
