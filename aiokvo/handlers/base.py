"""The handler contract, and the machinery every single-direction backend reuses.

A backend only has to say how to *enqueue* one copy
(:meth:`SingleDirectionHandler._submit`): it returns a :class:`Submission`
with a completion source. Everything asynchronous -- job-id bookkeeping,
FIFO ordering, the awaitable task, the finished stream, timing, releasing
pooled objects, graceful close -- lives here, once.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiokvo._util import AsyncResource, check_int
from aiokvo.errors import (
    DuplicateJobError,
    HandlerClosedError,
    HandlerOwnedError,
    TransferSpecError,
)
from aiokvo.handlers.stats import HandlerStatistics
from aiokvo.handlers.task import DEFAULT_MAX_BUFFERED, FinishedResults, ResultQueue, TransferTask
from aiokvo.runtime.poller import EventPoller, PollerMode, resolve_poller_mode
from aiokvo.runtime.sources import CompletionSource
from aiokvo.specs import TransferResult, TransferSpec, TransferType

if TYPE_CHECKING:
    import torch

    from aiokvo.memory.shared_region import SharedOffloadRegion

__all__ = [
    "CpuGpuHandlers",
    "OffloadingHandler",
    "SingleDirectionHandler",
    "Submission",
    "TransferTask",
]


class OffloadingHandler(FinishedResults, AsyncResource, ABC):
    """Moves blocks in one or more directions; see docs/async.md.

    Subclasses implement :meth:`transfer_async`, :meth:`wait` and
    :meth:`aclose`, and call :meth:`_report` once per finished transfer;
    the finished stream (:meth:`get_finished`) comes for free. It keeps at
    most ``max_buffered`` unread results, dropping the oldest beyond that
    (counted in :attr:`dropped_results`); ``max_buffered=0`` keeps none,
    for callers that only ``await`` their tasks.
    """

    def __init__(self, *, max_buffered: int = DEFAULT_MAX_BUFFERED) -> None:
        self._results = ResultQueue(max_buffered)
        self._sink = self._results  # where _report puts results (a worker may redirect it)
        self._owner: object | None = None  # the worker it reports to, once registered

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> TransferTask:
        """Enqueue the copy ``spec = (src, dst)`` before returning its task.

        Raises :class:`~aiokvo.errors.TransferSpecError` (nothing enqueued)
        for bad input: a duplicate live ``job_id``, out-of-range blocks, ...
        """

    @abstractmethod
    async def wait(self, job_ids: Iterable[int]) -> None:
        """Return once every live transfer in ``job_ids`` has finished.

        Ids that are not in flight (finished or unknown) are ignored.
        Results stay in :meth:`get_finished`; cancelling the wait cancels no copy.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Refuse new transfers, wait for those in flight, then release resources.

        Idempotent; concurrent callers all wait for the same close.
        """

    def statistics(self) -> HandlerStatistics:
        """A snapshot of this handler's transfers (see :class:`HandlerStatistics`).

        The base knows only its result stream; :class:`SingleDirectionHandler`
        (every built-in backend) counts transfers too.
        """
        return HandlerStatistics(
            buffered_results=len(self._results), dropped_results=self._results.dropped
        )

    def _report(self, result: TransferResult) -> None:
        """Publish one finished result to :meth:`get_finished` (or the worker's stream)."""
        self._sink.put(result)

    def _share_results(self, queue: ResultQueue, owner: object) -> None:
        """Send results to ``queue``, ``owner``'s stream, from now on (a worker
        merging handlers); a second call from the same owner does nothing.

        Results already buffered move along, so none is reported twice or lost;
        this handler's own stream stays empty from then on. Raises
        :class:`~aiokvo.errors.HandlerOwnedError` if another owner has it:
        moving its results would take them away from that worker's readers.
        """
        if self._owner is not None:
            if self._owner is owner:
                return
            raise HandlerOwnedError(
                f"{self!r} is already registered with {self._owner!r}, which reads its "
                f"results; register it with one worker only"
            )
        for result in self._results.take_all():
            queue.put(result)
        self._sink = queue
        self._owner = owner


@dataclass(slots=True)
class Submission:
    """What a backend returns for one enqueued copy.

    ``source`` completes when the copy is done (or raises its failure);
    ``lane`` is the FIFO lane the poller watches it on (one per direction or
    stream). ``elapsed``, if given, is called once after success and returns
    the copy's duration in seconds (e.g. from CUDA timing events); otherwise
    the wall time from submission to observed completion is reported.
    ``release`` is called exactly once after completion, success or not, to
    drop references and return pooled objects.
    """

    source: CompletionSource
    transfer_size: int
    lane: Hashable
    elapsed: Callable[[], float | None] | None = None
    release: Callable[[], None] | None = None


class _InFlight:
    __slots__ = (
        "done", "error", "finished_at", "future", "job_id", "started_at", "submission", "task",
    )

    def __init__(
        self,
        job_id: int,
        submission: Submission,
        future: asyncio.Future[TransferResult],
        started_at: float,
    ) -> None:
        self.job_id = job_id
        self.submission = submission
        self.future = future
        self.started_at = started_at
        self.finished_at = 0.0
        self.done = False
        self.error: BaseException | None = None
        self.task: TransferTask | None = None


class SingleDirectionHandler(OffloadingHandler):
    """One direction (``transfer_type``) of copies, finished in submission order.

    Subclasses implement :meth:`_submit`, and :meth:`_close_backend` if they
    own threads, streams or memory. ``poller_mode`` overrides the loop
    poller's mode for this handler's lanes. ``transfer_async`` must be
    called on the loop's thread, with the loop running.
    """

    def __init__(
        self,
        transfer_type: TransferType,
        *,
        poller_mode: PollerMode | None = None,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
    ) -> None:
        super().__init__(max_buffered=max_buffered)
        self.transfer_type: TransferType = transfer_type
        self.poller_mode: PollerMode | None = (
            None if poller_mode is None else resolve_poller_mode(poller_mode)
        )
        if poller_mode is None:
            resolve_poller_mode()  # a bad $AIOKVO_POLLER_MODE fails here, not per transfer
        self._live: dict[int, _InFlight] = {}
        self._good_routes: set[tuple[type, type]] = set()
        self._order: deque[_InFlight] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: EventPoller | None = None
        self._closing = False
        self._closed = False
        self._drained: asyncio.Future[None] | None = None
        self._close_task: asyncio.Future[None] | None = None
        self._completed = 0
        self._failed = 0
        self._bytes = 0
        self._seconds = 0.0

    # -------------------------------------------------------------- backend API
    @abstractmethod
    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        """Validate ``spec``, enqueue the copy and describe it.

        Raise :class:`~aiokvo.errors.TransferSpecError` subclasses for caller
        bugs *before* enqueuing anything. Any other exception propagates out
        of :meth:`transfer_async` (the worker turns it into a failed result).
        """

    async def _close_backend(self) -> None:
        """Release backend resources; called once, after everything in flight finished."""

    # --------------------------------------------------------------- public API
    @property
    def in_flight(self) -> int:
        """Transfers submitted and not yet finished."""
        return len(self._live)

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has begun."""
        return self._closing

    def statistics(self) -> HandlerStatistics:
        return HandlerStatistics(
            transfer_type=self.transfer_type,
            completed=self._completed,
            failed=self._failed,
            in_flight=len(self._live),
            bytes=self._bytes,
            seconds=self._seconds,
            buffered_results=len(self._results),
            dropped_results=self._results.dropped,
        )

    def transfer_async(self, job_id: int, spec: TransferSpec) -> TransferTask:
        job_id = check_int("job_id", job_id, error=TransferSpecError)
        if self._closing:
            raise HandlerClosedError(
                f"{type(self).__name__} {self.transfer_type} is closed; "
                f"job_id {job_id} was not submitted"
            )
        if job_id in self._live:
            raise DuplicateJobError(
                f"job_id {job_id} is still in flight on {type(self).__name__} {self.transfer_type}"
            )
        loop = asyncio.get_running_loop()
        poller = self._poller
        if loop is not self._loop or poller is None or poller.closed:
            poller = self._bind(loop)
        submission = self._submit(job_id, spec)
        entry = _InFlight(job_id, submission, loop.create_future(), time.perf_counter())
        task = entry.task = TransferTask(job_id, entry.future)
        try:
            poller.add_callback(
                submission.lane,
                submission.source,
                lambda error: self._on_complete(entry, error),
                mode=self.poller_mode,
            )
        except BaseException:
            self._release(entry)
            raise
        self._live[job_id] = entry
        self._order.append(entry)
        return task

    async def wait(self, job_ids: Iterable[int]) -> None:
        futures = [self._live[j].future for j in job_ids if j in self._live]
        if futures:
            await asyncio.wait(futures)  # unlike gather, never cancels them

    async def aclose(self) -> None:
        if self._close_task is None:
            self._closing = True
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    def __repr__(self) -> str:
        state = "closed" if self._closing else f"in_flight={len(self._live)}"
        return f"<{type(self).__name__} {self.transfer_type[0]}->{self.transfer_type[1]} {state}>"

    # ---------------------------------------------------------------- internals
    def _check_route(self, spec: TransferSpec) -> TransferSpec:
        """``spec`` if its media are :attr:`transfer_type`, for backends to call in
        :meth:`_submit`; spec types seen before pass at once."""
        try:
            src_spec, dst_spec = spec
        except (TypeError, ValueError):
            raise TransferSpecError(
                f"a transfer spec is a (src_spec, dst_spec) pair, got {spec!r}"
            ) from None
        kinds = (type(src_spec), type(dst_spec))
        if kinds not in self._good_routes:
            route = (src_spec.medium(), dst_spec.medium())
            if route != self.transfer_type:
                raise TransferSpecError(
                    f"this handler copies {self.transfer_type[0]} -> {self.transfer_type[1]}, "
                    f"got a {route[0]} -> {route[1]} spec"
                )
            self._good_routes.add(kinds)
        return spec

    def _bind(self, loop: asyncio.AbstractEventLoop) -> EventPoller:
        if self._loop is not None and loop is not self._loop and self._live:
            raise RuntimeError(
                f"{self!r} has transfers in flight on another event loop; use one handler per loop"
            )
        self._loop = loop
        self._poller = EventPoller.for_loop(loop)
        return self._poller

    ordered: bool = True
    """Finish transfers in submission order, across lanes (the handler contract). A
    backend whose transfers are independent by design (a tier's read slots, where one
    stalled read must not hold up another's) sets it False: each finishes as it ends."""

    def _on_complete(self, entry: _InFlight, error: BaseException | None) -> None:
        if entry.done:
            return  # abandoned at close already: its late completion changes nothing
        entry.finished_at = time.perf_counter()
        entry.error = error
        entry.done = True
        order = self._order
        if not self.ordered:
            order.remove(entry)
            self._finish(entry)
            return
        # Finish strictly in submission order, even across several lanes.
        while order and order[0].done:
            self._finish(order.popleft())

    def _finish(self, entry: _InFlight) -> None:
        submission = entry.submission
        error = entry.error
        elapsed: float | None = None
        if error is None and submission.elapsed is not None:
            try:
                elapsed = submission.elapsed()
            except Exception as exc:
                self._report_hook_error("elapsed", exc)
        if elapsed is None:
            elapsed = entry.finished_at - entry.started_at
        self._release(entry)
        result = TransferResult(
            job_id=entry.job_id,
            success=error is None,
            transfer_size=submission.transfer_size,
            transfer_time=elapsed,
            transfer_type=self.transfer_type,
            error=error,
        )
        del self._live[entry.job_id]
        self._completed += 1
        if error is None:
            self._bytes += submission.transfer_size
            self._seconds += elapsed
        else:
            self._failed += 1
        task = entry.task
        if task is not None:
            task._set_result(result)  # wakes its awaiters now, not an iteration later
        else:
            entry.future.set_result(result)
        self._report(result)
        if not self._live and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _release(self, entry: _InFlight) -> None:
        release = entry.submission.release
        if release is not None:
            try:
                release()
            except Exception as exc:
                self._report_hook_error("release", exc)

    def _report_hook_error(self, hook: str, error: Exception) -> None:
        loop = self._loop or asyncio.get_running_loop()
        loop.call_exception_handler(
            {"message": f"{self!r}: Submission.{hook} raised", "exception": error}
        )

    def _close_timeout(self) -> float | None:
        """Seconds :meth:`aclose` waits for the transfers in flight (None: as long as
        they take). A backend whose I/O can hang (a tier) bounds it; see
        :meth:`_abandon_in_flight`."""
        return None

    def _abandon_in_flight(self, error: BaseException) -> int:
        """Finish every transfer still in flight now, failed with ``error``; how many.

        For a close that cannot wait any longer: the copy itself may go on (its
        source completes later, unseen), so the caller must keep everything it
        touches alive until it does.
        """
        now = time.perf_counter()
        abandoned = 0
        for entry in self._order:
            if not entry.done:
                entry.finished_at, entry.error, entry.done = now, error, True
                abandoned += 1
        order = self._order
        while order:
            self._finish(order.popleft())
        return abandoned

    def _on_abandon(self, abandoned: int) -> None:
        """Called once a bounded close abandoned ``abandoned`` transfers."""

    async def _close(self) -> None:
        if self._live:
            self._drained = asyncio.get_running_loop().create_future()
            timeout = self._close_timeout()
            try:
                await asyncio.wait_for(asyncio.shield(self._drained), timeout)
            except TimeoutError:
                error = HandlerClosedError(
                    f"{self!r} closed with transfers still running after {timeout} s; "
                    "they were abandoned"
                )
                self._on_abandon(self._abandon_in_flight(error))
        try:
            await self._close_backend()
        finally:
            self._closed = True
            self._results.close()


@dataclass(slots=True)
class CpuGpuHandlers(AsyncResource):
    """A store (``gpu_to_cpu``) and a load (``cpu_to_gpu``) handler sharing one CPU pool.

    ``cpu_tensors[i]`` holds the offloaded blocks of canonical tensor ``i``.
    Every backend builds one of these (``make_host_handlers``,
    ``make_cuda_handlers``); closing closes both handlers. ``region`` is the
    shared region the pool's tensors are views of, if any: the pair borrows
    it, so closing drops the views (``cpu_tensors`` becomes empty) and leaves
    the region open for whoever opened it to close. ``row_tail_bytes`` is the
    room every row of the pool has after its KV bytes, outside the views
    (what was asked for, or 0 where the pool cannot give it: a region's).
    """

    gpu_to_cpu: OffloadingHandler
    cpu_to_gpu: OffloadingHandler
    cpu_tensors: tuple[torch.Tensor, ...]
    region: SharedOffloadRegion | None = None
    row_tail_bytes: int = 0

    async def aclose(self) -> None:
        """Close both directions (each waits for its copies in flight)."""
        try:
            await self.gpu_to_cpu.aclose()
        finally:
            try:
                await self.cpu_to_gpu.aclose()
            finally:
                if self.region is not None:
                    self.cpu_tensors = ()  # the region can only unmap once its views are gone
