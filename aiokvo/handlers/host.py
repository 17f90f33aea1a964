"""The host backend: copies between CPU tensors on worker threads.

Here the "GPU" KV caches are CPU tensors, so the backend runs on any machine;
it is what tests, CI and the demo use without a device.

A transfer is validated and planned on the caller's thread (the handler's
:class:`~aiokvo.handlers.plan.TransferPlanner`), so bad input raises from
``transfer_async`` before anything is enqueued. Each handler owns one
dispatch thread, which runs its transfers strictly in submission order (FIFO
per direction) and may split one transfer's tensors across
``copy_threads - 1`` helper threads. Tiny transfers are dominated by this
per-transfer bookkeeping, not by the copy, so it is kept to a few
microseconds: spec-independent checks and page views are cached, the
dispatch thread drains a plain deque (no ``Future`` per transfer), and one
event object per transfer carries both completion and timing.

The copy does one fancy-indexing assignment per tensor, never a Python loop
per page, over one of two page views. By default every page is one ``np.void``
element, which numpy copies holding the GIL. With ``copy_threads > 1``, a
transfer of ``SPLIT_MIN_BYTES`` or more views its pages as 2-D int64 rows
(when they are whole, aligned 8-byte words on both sides), which numpy copies
with the GIL released, and splits its tensors between the dispatch thread and
the helpers. That is faster while the event loop waits, but each tensor's copy
must win the GIL back, which a busy loop delays by up to the switch interval
(the GIL convoy), so it is opt-in. numpy is used rather than torch's
``index_copy_``, which was slower on the same rows (measured in
``benchmarks/results_host.md``).

A loop that keeps running Python can starve the dispatch thread of the GIL
for seconds (the GIL convoy, docs/async.md). Two things bound that delay:

* A copy, once started, never needs the GIL back before the loop can see
  it finished: the copies (:func:`host_copy_steps`), the completion mark
  (``end``) and the dispatcher's release run as one pass of C-level calls,
  with no Python bytecode at which the thread could be made to yield.
* A copy the thread has not started ``inline_after`` seconds after it was
  queued is run by the loop itself when the poller polls it (the
  ``AssistableSource`` protocol), in order, one job at a time either way.

Fault injection: pass ``copy_fn`` to run something else on the dispatch
thread in place of :func:`apply_host_copies`. Whatever it raises fails that
transfer (``TransferResult.success`` is false and ``error`` is the exception).
"""

from __future__ import annotations

import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain, repeat, starmap
from typing import Any

import numpy as np
import torch

from aiokvo.errors import ConfigError, LayoutError, TransferSpecError
from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.plan import Int64Array, TransferPlanner
from aiokvo.handlers.task import DEFAULT_MAX_BUFFERED
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.poller import PollerMode
from aiokvo.runtime.sources import HostEvent
from aiokvo.specs import TransferSpec

__all__ = [
    "DEFAULT_COPY_THREADS",
    "INLINE_AFTER",
    "CopyFn",
    "HostCopy",
    "HostOffloadingHandler",
    "apply_host_copies",
    "host_copy_steps",
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

SPLIT_MIN_BYTES = 1 << 20
"""With ``copy_threads > 1``, transfers of at least this many bytes are split
across threads; smaller ones run whole on the dispatch thread, as with one
thread: handing a share to a helper costs tens of microseconds, more than
copying a few hundred KiB, and tiny transfers must stay cheap."""


@dataclass(frozen=True, slots=True)
class HostCopy:
    """Copy elements ``src_rows`` of ``src`` into elements ``dst_rows`` of ``dst``.

    ``src`` and ``dst`` view the tensors' memory as pages along axis 0, the
    same way on both sides: 2-D int64 ``(pages, page_bytes // 8)`` arrays, or
    1-D arrays of ``np.void`` page elements where pages are not whole aligned
    words (see :func:`_page_elements`). ``*_start`` is
    the first index when the indices form one ascending run (a slice then
    replaces fancy indexing and saves a pass), else ``None``.
    """

    src: np.ndarray
    dst: np.ndarray
    src_rows: Int64Array
    dst_rows: Int64Array
    src_start: int | None
    dst_start: int | None

    @property
    def nbytes(self) -> int:
        src = self.src
        page = src.itemsize * (int(src.shape[1]) if src.ndim == 2 else 1)
        return int(self.src_rows.shape[0]) * page


CopyFn = Callable[[Sequence[HostCopy]], None]
"""What the dispatch thread runs for one transfer (see :func:`apply_host_copies`)."""


_GETITEM: Callable[[Any, Any], Any] = operator.getitem
_SETITEM: Callable[[Any, Any, Any], None] = operator.setitem


def host_copy_steps(copies: Sequence[HostCopy]) -> Iterator[object]:
    """``copies`` as a lazy pass of C-level calls: exhausting it does the copies.

    Everything Python has to decide (slices for runs, which call to use) is
    decided here, up front; the returned iterator only calls numpy through
    ``map``, so running it executes no Python bytecode, and the thread that
    runs it cannot be made to give up the GIL half-way (see the module
    docstring). A run on the destination with scattered sources is gathered
    straight into place (``ndarray.take(..., out=)``); a run on both sides is
    one slice assignment; anything else is one fancy-indexed assignment.
    """
    take_src: list[np.ndarray] = []
    take_rows: list[Int64Array] = []
    take_out: list[np.ndarray] = []
    srcs: list[np.ndarray] = []
    src_keys: list[Int64Array | slice] = []
    dsts: list[np.ndarray] = []
    dst_keys: list[Int64Array | slice] = []
    for copy in copies:
        n = int(copy.src_rows.shape[0])
        if n == 0:
            continue
        src_key: Int64Array | slice = copy.src_rows
        if copy.src_start is not None:
            src_key = slice(copy.src_start, copy.src_start + n)
        dst_key: Int64Array | slice = copy.dst_rows
        if copy.dst_start is not None:
            dst_key = slice(copy.dst_start, copy.dst_start + n)
            if copy.src_start is None:
                out = copy.dst[dst_key]
                if out.flags.c_contiguous:
                    take_src.append(copy.src)
                    take_rows.append(copy.src_rows)
                    take_out.append(out)
                    continue
        srcs.append(copy.src)
        src_keys.append(src_key)
        dsts.append(copy.dst)
        dst_keys.append(dst_key)
    moves = map(_SETITEM, dsts, dst_keys, map(_GETITEM, srcs, src_keys))
    if not take_src:
        return moves
    return chain(map(np.ndarray.take, take_src, take_rows, repeat(0), take_out), moves)


def apply_host_copies(copies: Sequence[HostCopy]) -> None:
    """Run ``copies`` on the calling thread (see :func:`host_copy_steps`)."""
    deque(host_copy_steps(copies), maxlen=0)


_ORIGINAL_APPLY = apply_host_copies


class HostOffloadingHandler(SingleDirectionHandler):
    """One direction between CPU-resident KV caches and a CPU block pool.

    ``cpu_tensors[i]`` is the pool for canonical tensor ``i`` of
    ``kv_caches``: shape ``(num_cpu_blocks, page_size_bytes * block_size_factor)``,
    int8, contiguous. ``gpu_to_cpu`` picks the direction (stores when true,
    loads when false). ``copy_threads`` threads share each transfer's
    copies; ``copy_fn`` replaces the copy (for fault injection) and then
    runs alone on the dispatch thread. A copy still queued ``inline_after``
    seconds after submission is run on the event loop when the poller polls
    it (the dispatch thread is starved); ``None`` keeps every copy off the
    loop, as do ``copy_fn`` and split copies (``copy_threads > 1``).
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
    ) -> None:
        super().__init__(
            ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU"),
            poller_mode=poller_mode,
            max_buffered=max_buffered,
        )
        _check_pool(kv_caches, cpu_tensors, block_size_factor)
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or copy_threads < 1:
            raise ConfigError(f"copy_threads must be an int >= 1, got {copy_threads!r}")
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
        self.copy_threads = copy_threads
        gpu = [t.tensor for t in kv_caches.tensors]
        cpu = list(self.cpu_tensors)
        src, dst = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
        self._planner = TransferPlanner(kv_caches.group_data_refs, src, dst, block_size_factor)
        self._src_tensors, self._dst_tensors = src, dst
        self._page_views: dict[tuple[int, int, int, int, bool], tuple[np.ndarray, np.ndarray]] = {}
        self._copy_fn: CopyFn = copy_fn or _apply_alone
        self._splits = copy_fn is None and copy_threads > 1
        direction = "g2c" if gpu_to_cpu else "c2g"
        self._dispatch = _DispatchThread(f"aiokvo-host-{direction}")
        self._helpers = (
            ThreadPoolExecutor(copy_threads - 1, thread_name_prefix=f"aiokvo-host-{direction}-h")
            if copy_threads > 1
            else None
        )
        self._lane = (type(self).__name__, direction, id(self))
        self._good_routes: set[tuple[type, type]] = set()

    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        plan = self._planner.plan(self._check_route(spec))
        split = self._splits and plan.total_bytes >= SPLIT_MIN_BYTES
        pages = self._pages
        views: tuple[np.ndarray, np.ndarray]
        copies: list[HostCopy] = []
        src_rows = dst_rows = None  # tensors of one group share their index arrays
        src_start = dst_start = None
        for c in plan.row_copies():
            if c.src_rows is not src_rows:
                src_rows, src_start = c.src_rows, _run_start(c.src_rows)
            if c.dst_rows is not dst_rows:
                dst_rows, dst_start = c.dst_rows, _run_start(c.dst_rows)
            views = pages(c.tensor_idx, plan.src_factor, plan.dst_factor, c.nbytes, split)
            copies.append(
                HostCopy(
                    views[0],
                    views[1],
                    c.src_rows,
                    c.dst_rows,
                    src_start,
                    dst_start,
                )
            )
        # Only the handler's own copy is ever run on the loop: a split copy waits on
        # helper threads, and a caller's copy_fn may block on anything.
        own = not split and self._copy_fn is _apply_alone
        event = _TimedHostEvent(self._dispatch, self.inline_after if own else None)
        self._dispatch.submit(self._copy_in_parallel if split else self._copy_fn, copies, event)
        return Submission(
            source=event, transfer_size=plan.total_bytes, lane=self._lane, elapsed=event.elapsed
        )

    def _check_route(self, spec: TransferSpec) -> TransferSpec:
        """``spec`` if it goes this handler's way; spec types seen before are not re-checked."""
        try:
            src_spec, dst_spec = spec
        except (TypeError, ValueError):
            raise TransferSpecError(
                f"a transfer spec is a (src_spec, dst_spec) pair, got {spec!r}"
            ) from None
        types = (type(src_spec), type(dst_spec))
        if types not in self._good_routes:
            _check_route(spec, self.transfer_type)
            self._good_routes.add(types)
        return spec

    async def _close_backend(self) -> None:
        # Everything in flight has finished, so the threads are idle: joining is instant.
        self._dispatch.shutdown()
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    def _copy_in_parallel(self, copies: Sequence[HostCopy]) -> None:
        helpers = self._helpers
        assert helpers is not None
        if len(copies) < 2:
            apply_host_copies(copies)
            return
        shares = _split_by_bytes(copies, self.copy_threads)
        futures: list[Future[None]] = [helpers.submit(apply_host_copies, s) for s in shares[1:]]
        error: BaseException | None = None
        try:
            apply_host_copies(shares[0])
        except BaseException as exc:
            error = exc
        for future in futures:  # wait for every share, even after a failure
            error = error or future.exception()
        if error is not None:
            raise error

    def _pages(
        self, tensor_idx: int, src_factor: int, dst_factor: int, nbytes: int, words: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination tensor ``tensor_idx`` as ``nbytes`` pages along axis 0
        (cached), the same kind on both sides: int64 words if ``words`` and both sides
        allow it (the copy then releases the GIL), else ``np.void`` pages (it holds it)."""
        key = (tensor_idx, src_factor, dst_factor, nbytes, words)
        views = self._page_views.get(key)
        if views is None:
            src, dst = self._src_tensors[tensor_idx], self._dst_tensors[tensor_idx]
            as_words = (
                (_page_words(src, src_factor, nbytes), _page_words(dst, dst_factor, nbytes))
                if words
                else (None, None)
            )
            if as_words[0] is not None and as_words[1] is not None:
                views = (as_words[0], as_words[1])
            else:
                views = (_page_voids(src, src_factor, nbytes), _page_voids(dst, dst_factor, nbytes))
            self._page_views[key] = views
        return views


def _apply_alone(copies: Sequence[HostCopy]) -> None:
    """:func:`apply_host_copies`, looked up when called (tests replace it)."""
    apply_host_copies(copies)


class _TimedHostEvent(HostEvent):
    """The transfer's completion source, also holding the copy's start and end as
    seen by whoever ran it (queueing time excluded): one object per transfer.

    ``end`` doubles as the completion mark: it is written by the copy's last
    C-level step, so :meth:`query` sees the copy finished even while the
    copying thread waits for the GIL to call ``set()``.
    """

    __slots__ = ("_dispatch", "_patience", "end", "start")

    def __init__(
        self, dispatch: _DispatchThread | None = None, patience: float | None = None
    ) -> None:
        super().__init__()
        self.start = 0.0
        self.end = 0.0
        self._dispatch = dispatch
        self._patience = patience

    def elapsed(self) -> float | None:
        return self.end - self.start if self.end else None

    def query(self) -> bool:
        return bool(self.end) or super().query()

    def assist(self) -> bool:
        """On the loop thread: run the overdue queued copies (this one included)."""
        if self._dispatch is None or self._patience is None or self.end:
            return False
        return self._dispatch.assist(self._patience)


_Job = tuple[CopyFn, Sequence[HostCopy], _TimedHostEvent, float]


class _DispatchThread:
    """One thread running a handler's copies in submission order (FIFO per direction).

    Cheaper per transfer than a ``ThreadPoolExecutor`` (no ``Future``, no
    work-item, no wake-up while the thread is busy): ``submit`` appends to a
    deque and only takes the lock to wake the thread when it sleeps. The
    thread drains everything queued before it sleeps again, so a burst of
    small transfers costs one wake-up. It exits after ``idle_timeout``
    seconds without work and starts again on the next submission.

    Jobs are claimed under the lock and run one at a time (``_busy``), by
    the thread or, through :meth:`assist`, by the event loop when the thread
    has not claimed an overdue job: whoever claims runs it, so each job runs
    once and they start in order.
    """

    def __init__(self, name: str, idle_timeout: float = 5.0) -> None:
        self._name = name
        self._idle_timeout = idle_timeout
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._idle = True  # true from before the thread looks for work until it runs again
        self._busy = False  # a job is running, on the thread or on the loop
        self._shutdown = False

    def submit(self, copy_fn: CopyFn, copies: Sequence[HostCopy], event: _TimedHostEvent) -> None:
        if self._shutdown:
            raise RuntimeError(f"{self._name} was shut down")
        self._queue.append((copy_fn, copies, event, time.perf_counter()))
        # The thread sets _idle (under the lock) *before* its last look at the queue,
        # and we look at _idle *after* appending: one of the two sees the other.
        if self._idle:
            with self._cond:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._idle = False
                    self._thread.start()
                else:
                    self._cond.notify()

    def assist(self, patience: float) -> bool:
        """Run, here and in order, each queued job older than ``patience`` seconds
        that the thread has not claimed; True if any ran. For the loop thread."""
        queue = self._queue
        if self._busy:
            return False  # the common case, decided without the lock
        try:
            enqueued = queue[0][3]
        except IndexError:  # empty, or the thread took the last job just now
            return False
        if time.perf_counter() - enqueued < patience:
            return False
        ran = False
        while True:
            with self._cond:
                if self._busy or not queue or time.perf_counter() - queue[0][3] < patience:
                    if ran and queue:
                        self._cond.notify()  # the thread may be waiting for us to finish
                    return ran
                job = queue.popleft()
                self._busy = True
            _execute(job, self, inline=True)
            ran = True

    def shutdown(self) -> None:
        """Stop the thread once the queue is empty, and join it."""
        with self._cond:
            self._shutdown = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        queue = self._queue
        cond = self._cond
        while True:
            with cond:
                if not queue or self._busy:
                    self._idle = True
                    if queue or not self._shutdown:
                        cond.wait(self._idle_timeout)
                    if not queue:
                        # Idle too long, or shut down: the next submit restarts the thread.
                        self._thread = None
                        return
                    if self._busy:
                        continue  # the loop is running a job itself; it notifies when done
                job = queue.popleft()
                self._busy = True
                self._idle = False
            _execute(job, self, inline=False)


def _execute(job: _Job, dispatch: _DispatchThread, *, inline: bool) -> None:
    """Run one claimed job and publish its outcome; releases ``dispatch._busy``.

    The copy, the completion mark (``event.end``) and the release are one
    pass of C-level calls (``deque`` over ``chain``), so no Python bytecode
    runs between the last byte copied and the loop being able to see it.
    """
    copy_fn, copies, event, _ = job
    steps = _copy_steps(copy_fn, copies)
    finish = map(
        setattr,
        (event, dispatch),
        ("end", "_busy"),
        chain(starmap(time.perf_counter, ((),)), (False,)),
    )
    event.start = time.perf_counter()
    try:
        deque(chain(steps, finish), maxlen=0)
    except BaseException as exc:  # the copy's failure is the transfer's result
        dispatch._busy = False
        event.set_exception(exc)
        if inline and not isinstance(exc, Exception):
            raise  # never swallow KeyboardInterrupt & co. on the loop thread
    else:
        event.set()


def _copy_steps(copy_fn: CopyFn, copies: Sequence[HostCopy]) -> Iterator[object]:
    """The default copy as C-level steps; any other ``copy_fn`` (a split copy,
    fault injection, a test's replacement of ``apply_host_copies``) as one call."""
    if copy_fn is _apply_alone and apply_host_copies is _ORIGINAL_APPLY:
        return host_copy_steps(copies)
    return map(copy_fn, (copies,))


_WORD = 8


def _page_rows(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray:
    """``(rows, width)`` int8 as ``(rows * factor, nbytes)`` int8: one row per page."""
    rows, width = (int(n) for n in tensor.shape)
    if factor > 1:
        tensor = tensor.view(rows * factor, width // factor)
    return tensor.numpy()[:, :nbytes]


def _page_words(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray | None:
    """The pages as an ``(pages, nbytes // 8)`` int64 array, or ``None`` where a page
    does not start on and span whole 8-byte words.

    On int64 rows numpy copies each page with a word loop and releases the GIL,
    so helper threads copy in parallel; on ``np.void`` elements it was slower on
    one thread and did not scale to two (``benchmarks/results_host.md``).
    """
    array = _page_rows(tensor, factor, nbytes)
    address = int(array.__array_interface__["data"][0])
    if nbytes % _WORD or address % _WORD or int(array.strides[0]) % _WORD:
        return None
    return array.view(np.int64)


def _page_voids(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray:
    """The pages as a 1-D array of ``np.void`` elements of ``nbytes`` (any alignment)."""
    return _page_rows(tensor, factor, nbytes).view(np.dtype((np.void, nbytes))).reshape(-1)


def _page_elements(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray:
    """The pages along axis 0: int64 words where aligned, else ``np.void`` elements.

    A copy needs the same kind on both sides; the handler checks both (``_pages``).
    """
    words = _page_words(tensor, factor, nbytes)
    return words if words is not None else _page_voids(tensor, factor, nbytes)


def _split_by_bytes(copies: Sequence[HostCopy], parts: int) -> list[list[HostCopy]]:
    """Deal copies to ``parts`` shares, largest first onto the lightest share."""
    shares: list[list[HostCopy]] = [[] for _ in range(min(parts, len(copies)))]
    loads = [0] * len(shares)
    for copy in sorted(copies, key=lambda c: c.nbytes, reverse=True):
        lightest = loads.index(min(loads))
        shares[lightest].append(copy)
        loads[lightest] += copy.nbytes
    return shares


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


def _run_start(rows: Int64Array) -> int | None:
    n = int(rows.shape[0])
    if n == 0:
        return None
    if n == 1:
        return int(rows[0])
    first = int(rows[0])
    if int(rows[-1]) - first != n - 1:
        return None
    if n > 2 and not bool(np.all(np.diff(rows) == 1)):
        return None
    return first
