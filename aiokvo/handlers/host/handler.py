"""The host backend: copies between CPU tensors on a dispatch thread.

Here the "GPU" KV caches are CPU tensors, so the backend runs on any machine;
it is what tests, CI and the demo use without a device.

A transfer is validated and planned on the caller's thread (the handler's
:class:`~aiokvo.plan.TransferPlanner`), so bad input raises from
``transfer_async`` before anything is enqueued. Each handler owns one
:class:`~aiokvo.handlers.host.dispatch.DispatchThread`, which runs its
transfers strictly in submission order (FIFO per direction) and may split
one transfer's tensors across ``copy_threads - 1`` helper threads. Tiny
transfers are dominated by per-transfer bookkeeping, not by the copy, so it
is kept to a few microseconds: spec-independent checks and page views are
cached and one event object per transfer carries completion and timing.

By default every page is one ``np.void`` element, which numpy copies holding
the GIL. With ``copy_threads > 1``, a transfer of ``split_min_bytes`` or more
views its pages as int64 word rows (when they are whole, aligned words on
both sides), which numpy copies with the GIL released, and splits its
tensors between the dispatch thread and the helpers. That is faster while
the event loop waits, but each share must win the GIL back, which a busy
loop delays (the GIL convoy), so it is opt-in. numpy is used rather than
torch's ``index_copy_``, which was slower on the same rows
(``benchmarks/results_host.md``).

``copy_fn`` replaces the copy (for fault injection or instrumentation): it
is called with a transfer's copies (with splits, once per share, on the
thread that runs the share). Whatever it raises fails that transfer.

The CPU pool may be strided: a shared region's views have a row stride that
spans every tensor and every rank. With ``block_size_factor > 1`` such a
row's pages are not evenly spaced, so the pool tensor is copied through one
part per page position (:func:`~aiokvo.handlers.host.copies.page_parts`):
a transfer then makes up to ``factor`` copies per tensor instead of one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

from aiokvo._util import check_int
from aiokvo.errors import ConfigError, LayoutError
from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.host.copies import (
    CopyFn,
    HostCopy,
    apply_host_copies,
    host_copy_steps,
    page_parts,
    page_voids,
    page_words,
    run_start,
    split_by_bytes,
    split_by_part,
)
from aiokvo.handlers.host.dispatch import DispatchEvent, DispatchThread, Work
from aiokvo.handlers.task import DEFAULT_MAX_BUFFERED
from aiokvo.layout import CanonicalKVCaches
from aiokvo.plan import Int64Array, RowCopy, TransferPlan, TransferPlanner
from aiokvo.runtime.poller import PollerMode
from aiokvo.specs import TransferSpec

__all__ = [
    "DEFAULT_COPY_THREADS",
    "INLINE_AFTER",
    "INLINE_BELOW_BYTES",
    "SPLIT_MIN_BYTES",
    "HostOffloadingHandler",
    "check_host_caches",
]

DEFAULT_COPY_THREADS = 1
"""Threads sharing one transfer's copies, dispatch thread included. One keeps the
copy holding the GIL, which is safe next to a busy event loop; two copy 32 KiB
pages ~1.4x faster while the loop is idle but can starve when it is busy (the
GIL convoy measured in ``benchmarks/results_host.md``), so it is opt-in."""

INLINE_AFTER = 0.002
"""Seconds a queued copy may wait for the dispatch thread before the loop runs
it itself. An idle loop lets the thread start within tens of microseconds, so
this only fires when the thread is starved (a CPU-busy loop) or the machine is
badly oversubscribed; either way the copy is done, in order, exactly once."""

INLINE_BELOW_BYTES = 128 << 10
"""Transfers smaller than this are copied on the submitting thread, inside
``transfer_async``, when the dispatch thread has nothing queued or running
(so submission order holds). Handing a copy to the thread and its completion
back costs two wake-ups and two GIL hand-overs, 100-400 us on a loaded 2-core
machine, while 128 KiB copy in about 15 us (``benchmarks/bench_transfer_path.py``).
Copies through a ``copy_fn`` and split copies always go to the thread."""

SPLIT_MIN_BYTES = 1 << 20
"""With ``copy_threads > 1``, transfers of at least this many bytes are split
across threads; smaller ones run whole on the dispatch thread, as with one
thread: handing a share to a helper costs tens of microseconds, more than
copying a few hundred KiB, and tiny transfers must stay cheap."""


class HostOffloadingHandler(SingleDirectionHandler):
    """One direction between CPU-resident KV caches and a CPU block pool.

    ``cpu_tensors[i]`` is the pool for canonical tensor ``i`` of
    ``kv_caches``: shape ``(num_cpu_blocks, page_size_bytes * block_size_factor)``,
    int8, rows byte-contiguous with any row stride (a shared region's
    :meth:`~aiokvo.memory.shared_region.SharedOffloadRegion.create_next_view`
    slices qualify). Both sides must be CPU tensors: KV caches on any other
    device (``meta``, ``mps``, ``xpu``, ``cuda``) raise
    :class:`~aiokvo.errors.LayoutError` here, not at every transfer.
    ``gpu_to_cpu`` picks the direction (stores when true,
    loads when false). ``copy_threads`` threads share each transfer's
    copies of ``split_min_bytes`` or more; ``copy_fn`` replaces the copy. A
    copy still queued ``inline_after`` seconds after submission is run on
    the event loop when the poller polls it (the dispatch thread is
    starved); ``None`` keeps every copy off the loop, as do ``copy_fn`` and
    split copies. ``dispatcher`` runs the copies (default: a thread of the
    handler's own, named ``aiokvo-host-g2c`` or ``-c2g``); the handler shuts
    down only a dispatcher it made. A closed handler holds no reference to
    either side's tensors, so a region they view can be unmapped.
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
        copy_threads: int = DEFAULT_COPY_THREADS,
        copy_fn: CopyFn | None = None,
        inline_after: float | None = INLINE_AFTER,
        inline_below_bytes: int = INLINE_BELOW_BYTES,
        split_min_bytes: int = SPLIT_MIN_BYTES,
        dispatcher: DispatchThread | None = None,
    ) -> None:
        super().__init__(
            ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU"),
            poller_mode=poller_mode,
            max_buffered=max_buffered,
        )
        block_size_factor = check_int("block_size_factor", block_size_factor, minimum=1)
        _check_pool(kv_caches, cpu_tensors, block_size_factor)
        self.copy_threads = check_int("copy_threads", copy_threads, minimum=1)
        self.split_min_bytes = check_int("split_min_bytes", split_min_bytes, minimum=0)
        self.inline_below_bytes = check_int("inline_below_bytes", inline_below_bytes, minimum=0)
        if inline_after is not None and (
            isinstance(inline_after, bool)
            or not isinstance(inline_after, (int, float))
            or not inline_after >= 0
        ):
            raise ConfigError(f"inline_after must be None or seconds >= 0, got {inline_after!r}")
        self.inline_after = None if inline_after is None else float(inline_after)
        self.kv_caches = kv_caches
        self.cpu_tensors: tuple[torch.Tensor, ...] = tuple(cpu_tensors)
        self.block_size_factor = block_size_factor
        self.gpu_to_cpu = gpu_to_cpu
        gpu = [t.tensor for t in kv_caches.tensors]
        cpu = list(self.cpu_tensors)
        src, dst = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
        self._planner = TransferPlanner(kv_caches.group_data_refs, src, dst, block_size_factor)
        self._src_tensors, self._dst_tensors = src, dst
        # Strided pool rows holding several pages are copied per page position.
        cpu_parts = [page_parts(t, block_size_factor) for t in cpu]
        no_parts: list[tuple[torch.Tensor, ...] | None] = [None] * len(gpu)
        self._src_parts, self._dst_parts = (
            (no_parts, cpu_parts) if gpu_to_cpu else (cpu_parts, no_parts)
        )
        self._split_pool = any(parts is not None for parts in cpu_parts)
        self._page_views: dict[_ViewKey, tuple[np.ndarray, np.ndarray]] = {}
        self._copy_fn = copy_fn
        direction = "g2c" if gpu_to_cpu else "c2g"
        self._owns_dispatcher = dispatcher is None
        self._dispatch = dispatcher or DispatchThread(f"aiokvo-host-{direction}")
        self._helpers = (
            ThreadPoolExecutor(
                self.copy_threads - 1, thread_name_prefix=f"aiokvo-host-{direction}-h"
            )
            if self.copy_threads > 1
            else None
        )
        self._lane = (type(self).__name__, direction, id(self))

    @property
    def dispatcher(self) -> DispatchThread:
        """The thread that runs this handler's copies, in submission order."""
        return self._dispatch

    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        plan = self._planner.plan(self._check_route(spec))
        split = self._helpers is not None and plan.total_bytes >= self.split_min_bytes
        copies = (self._part_copies if self._split_pool else self._copies)(plan, split)
        # Only the handler's own copy is ever run on the loop: a split copy waits on
        # helper threads, and a caller's copy_fn may block on anything.
        own = not split and self._copy_fn is None
        event = DispatchEvent(self._dispatch, self.inline_after if own else None)
        work = self._work(copies, split)
        if not (
            own
            and self.inline_after is not None  # None: no copy on the caller's thread
            and plan.total_bytes < self.inline_below_bytes
            and self._dispatch.run_now(work, event)
        ):
            self._dispatch.submit(work, event)
        return Submission(
            source=event, transfer_size=plan.total_bytes, lane=self._lane, elapsed=event.elapsed
        )

    def _copies(self, plan: TransferPlan, split: bool) -> list[HostCopy]:
        """One copy per tensor (and page size): every pool is paged as it is."""
        pages = self._pages
        copies: list[HostCopy] = []
        src_rows = dst_rows = None  # tensors of one group share their index arrays
        src_start = dst_start = None
        for c in plan.row_copies():
            if c.src_rows is not src_rows:
                src_rows, src_start = c.src_rows, run_start(c.src_rows)
            if c.dst_rows is not dst_rows:
                dst_rows, dst_start = c.dst_rows, run_start(c.dst_rows)
            src_view, dst_view = pages(
                (c.tensor_idx, plan.src_factor, plan.dst_factor, c.nbytes, split, -1, -1)
            )
            copies.append(
                HostCopy(src_view, dst_view, c.src_rows, c.dst_rows, src_start, dst_start)
            )
        return copies

    def _part_copies(self, plan: TransferPlan, split: bool) -> list[HostCopy]:
        """One copy per tensor and page position of a strided pool's rows."""
        copies: list[HostCopy] = []
        for c in plan.row_copies():
            copies.extend(self._copies_of(c, plan.src_factor, plan.dst_factor, split))
        return copies

    def _copies_of(
        self, c: RowCopy, src_factor: int, dst_factor: int, split: bool
    ) -> list[HostCopy]:
        src_split = src_factor if self._src_parts[c.tensor_idx] is not None else 0
        dst_split = dst_factor if self._dst_parts[c.tensor_idx] is not None else 0
        if not (src_split or dst_split):
            key = (c.tensor_idx, src_factor, dst_factor, c.nbytes, split, -1, -1)
            return [self._copy(key, c.src_rows, c.dst_rows)]
        return [
            self._copy(
                (c.tensor_idx, src_factor, dst_factor, c.nbytes, split, s_part, d_part),
                s_rows,
                d_rows,
            )
            for s_part, s_rows, d_part, d_rows in split_by_part(
                c.src_rows, src_split, c.dst_rows, dst_split
            )
        ]

    def _copy(self, key: _ViewKey, src_rows: Int64Array, dst_rows: Int64Array) -> HostCopy:
        src_view, dst_view = self._pages(key)
        return HostCopy(
            src_view, dst_view, src_rows, dst_rows, run_start(src_rows), run_start(dst_rows)
        )

    def _work(self, copies: list[HostCopy], split: bool) -> Work:
        """The dispatch job for one transfer's copies."""
        if split:
            return partial(_call_once, self._copy_in_parallel, copies)
        if self._copy_fn is None:
            return partial(host_copy_steps, copies)
        return partial(_call_once, self._copy_fn, copies)

    async def _close_backend(self) -> None:
        # Everything in flight has finished, so the threads are idle: joining is instant.
        try:
            if self._owns_dispatcher:
                self._dispatch.shutdown()
            if self._helpers is not None:
                self._helpers.shutdown(wait=True)
        finally:
            # Drop every view of the tensors: a shared region can only be
            # unmapped once nothing exports its memory.
            self._page_views.clear()
            self._src_tensors = self._dst_tensors = []
            self._src_parts = self._dst_parts = []
            self.cpu_tensors = ()

    def _copy_in_parallel(self, copies: Sequence[HostCopy]) -> None:
        helpers = self._helpers
        assert helpers is not None
        run = self._copy_fn or apply_host_copies
        if len(copies) < 2:
            run(copies)
            return
        shares = split_by_bytes(copies, self.copy_threads)
        futures: list[Future[None]] = [helpers.submit(run, s) for s in shares[1:]]
        error: BaseException | None = None
        try:
            run(shares[0])
        except BaseException as exc:
            error = exc
        for future in futures:  # wait for every share, even after a failure
            error = error or future.exception()
        if error is not None:
            raise error

    def _pages(self, key: _ViewKey) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination of ``key`` as pages along axis 0 (cached).

        ``key`` is ``(tensor_idx, src_factor, dst_factor, nbytes, words,
        src_part, dst_part)``: a part >= 0 pages that part of a split pool
        tensor (one page per row), -1 the whole tensor with its factor. Both
        sides are the same kind: int64 words if ``words`` and both sides allow
        it (the copy then releases the GIL), else ``np.void`` pages (it holds it).
        """
        views = self._page_views.get(key)
        if views is None:
            idx, src_factor, dst_factor, nbytes, words, src_part, dst_part = key
            src, src_factor = _side(self._src_tensors, self._src_parts, idx, src_part, src_factor)
            dst, dst_factor = _side(self._dst_tensors, self._dst_parts, idx, dst_part, dst_factor)
            src_words = page_words(src, src_factor, nbytes) if words else None
            dst_words = page_words(dst, dst_factor, nbytes) if words else None
            if src_words is not None and dst_words is not None:
                views = (src_words, dst_words)
            else:
                views = (page_voids(src, src_factor, nbytes), page_voids(dst, dst_factor, nbytes))
            self._page_views[key] = views
        return views


_ViewKey = tuple[int, int, int, int, bool, int, int]
"""``(tensor_idx, src_factor, dst_factor, nbytes, words, src_part, dst_part)``."""


def _side(
    tensors: Sequence[torch.Tensor],
    parts: Sequence[tuple[torch.Tensor, ...] | None],
    idx: int,
    part: int,
    factor: int,
) -> tuple[torch.Tensor, int]:
    """The tensor to page for one side of a copy, and its pages per row."""
    if part < 0:
        return tensors[idx], factor
    split = parts[idx]
    assert split is not None
    return split[part], 1


def _call_once(function: CopyFn, copies: Sequence[HostCopy]) -> Iterator[object]:
    """``function(copies)`` as a one-step job (it runs when the step is taken)."""
    return map(function, (copies,))


def check_host_caches(kv_caches: CanonicalKVCaches) -> None:
    """Raise :class:`LayoutError` naming the device unless ``kv_caches`` are CPU tensors.

    numpy cannot reach ``meta``, ``mps``, ``xpu`` or ``cuda`` memory, so the
    host backend refuses them when it is built, not at every transfer.
    """
    device = kv_caches.device
    if device.type != "cpu":
        raise LayoutError(
            f"the host backend copies between CPU tensors, but the KV caches are on "
            f"{device} (use the CUDA backend for cuda; other devices are not supported)"
        )


def _check_pool(
    kv_caches: CanonicalKVCaches, cpu_tensors: Sequence[torch.Tensor], factor: int
) -> None:
    check_host_caches(kv_caches)
    if len(cpu_tensors) != len(kv_caches.tensors):
        raise LayoutError(
            f"{len(kv_caches.tensors)} KV tensors need as many CPU pools, got {len(cpu_tensors)}"
        )
    for i, (kv, cpu) in enumerate(zip(kv_caches.tensors, cpu_tensors, strict=True)):
        if not isinstance(cpu, torch.Tensor) or cpu.device.type != "cpu":
            where = cpu.device if isinstance(cpu, torch.Tensor) else type(cpu).__name__
            raise LayoutError(f"CPU pool {i} must be a CPU tensor, got one on {where}")
        want = kv.page_size_bytes * factor
        if cpu.dtype != torch.int8 or cpu.ndim != 2 or (cpu.shape[1] > 1 and cpu.stride(1) != 1):
            raise LayoutError(
                f"CPU pool {i} must be a 2-D int8 tensor with byte-contiguous rows, "
                f"got {cpu.dtype} shape {tuple(cpu.shape)} strides {cpu.stride()}"
            )
        if cpu.shape[1] != want:
            raise LayoutError(
                f"CPU pool {i} rows must be page_size_bytes {kv.page_size_bytes} x "
                f"block_size_factor {factor} = {want} bytes, got {cpu.shape[1]}"
            )
        if cpu.shape[0] > 1 and cpu.stride(0) < want:
            raise LayoutError(
                f"CPU pool {i} rows overlap: row stride {cpu.stride(0)} < row width {want}"
            )
