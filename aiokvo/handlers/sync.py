"""``SyncOffloadingWorker``: the worker's API for callers without an event loop.

Some engines call their offloading worker synchronously, from a thread that
runs no event loop (vLLM's model runner does). This facade drives an
:class:`~aiokvo.handlers.worker.OffloadingWorker` through a
:class:`~aiokvo.runtime.pump.LoopDriver`: by default a private loop pumped
inside each call, on the caller's thread, so per-thread state such as
torch's current CUDA stream is the caller's when a transfer is enqueued.

With a driver that runs the loop on another thread, that state must be
handed over explicitly: ``before_submit`` is called on the caller's thread
just before each submission (for example to read the caller's compute
stream into a value the handlers' ``producer_stream`` callable returns;
the submission is enqueued before ``submit`` returns, so the two match).

It also retries failed copies: a transfer whose copy failed (not one the
handler refused as a caller bug) is submitted again, up to ``retries``
times, before its failure is reported. Both directions may be retried: a
load re-reads CPU blocks nobody else writes, and a store's GPU source
blocks stay the caller's until the store is reported finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiokvo._util import check_int
from aiokvo.errors import DuplicateJobError, HandlerClosedError, TransferSpecError
from aiokvo.handlers.worker import OffloadingWorker
from aiokvo.runtime.pump import LoopDriver
from aiokvo.specs import TransferResult, TransferSpec

__all__ = ["SyncOffloadingWorker", "SyncWorkerStatistics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SyncWorkerStatistics:
    """A snapshot of a :class:`SyncOffloadingWorker`'s counters."""

    submitted: int = 0
    """Transfers accepted by :meth:`SyncOffloadingWorker.submit`."""
    in_flight: int = 0
    """Transfers submitted and not yet reported (retries included)."""
    retried: int = 0
    """Resubmissions after a failed copy."""
    succeeded: int = 0
    """Transfers reported successful (after any retries)."""
    failed: int = 0
    """Transfers reported failed, after their retries."""


class _Job:
    __slots__ = ("attempts", "spec")

    def __init__(self, spec: TransferSpec) -> None:
        self.spec = spec
        self.attempts = 1


def _retryable(result: TransferResult) -> bool:
    return not isinstance(result.error, (TransferSpecError, HandlerClosedError))


class SyncOffloadingWorker:
    """Synchronous ``submit`` / ``get_finished`` / ``wait`` over an async worker.

    The facade owns neither ``worker`` nor ``driver``; call :meth:`close` to
    close the worker (inside the loop) and then close the driver yourself.
    Every result is reported once, by :meth:`get_finished`, in the order the
    worker finished them (a retried transfer is reported when its last
    attempt finishes).
    """

    def __init__(
        self,
        worker: OffloadingWorker,
        driver: LoopDriver,
        *,
        retries: int = 2,
        before_submit: Callable[[], object] | None = None,
    ) -> None:
        self.retries = check_int("retries", retries, minimum=0)
        self._before_submit = before_submit
        self._worker = worker
        self._driver = driver
        self._jobs: dict[int, _Job] = {}
        self._ready: list[TransferResult] = []
        self._submitted = 0
        self._retried = 0
        self._succeeded = 0
        self._failed = 0

    @property
    def driver(self) -> LoopDriver:
        return self._driver

    @property
    def worker(self) -> OffloadingWorker:
        return self._worker

    def statistics(self) -> SyncWorkerStatistics:
        return SyncWorkerStatistics(
            submitted=self._submitted,
            in_flight=len(self._jobs),
            retried=self._retried,
            succeeded=self._succeeded,
            failed=self._failed,
        )

    # ------------------------------------------------------------------ calls
    def submit(self, job_id: int, spec: TransferSpec) -> None:
        """Enqueue ``spec`` as ``job_id`` before returning.

        Caller bugs raise :class:`~aiokvo.errors.TransferSpecError` (a
        duplicate live ``job_id`` among them) and enqueue nothing.
        """
        if job_id in self._jobs:
            raise DuplicateJobError(f"job_id {job_id} is still in flight on this worker")
        if self._before_submit is not None:
            self._before_submit()
        self._driver.call(self._worker.transfer_async, job_id, spec)
        self._jobs[job_id] = _Job(spec)
        self._submitted += 1

    def get_finished(self) -> list[TransferResult]:
        """Every transfer finished since the last call, each reported once."""
        self._driver.call(self._collect)
        ready, self._ready = self._ready, []
        return ready

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every listed transfer has finished, retries included.

        Unknown and already-finished ids are ignored; results stay for
        :meth:`get_finished`.
        """
        pending = [j for j in job_ids if j in self._jobs]
        while pending:
            self._driver.run(self._worker.wait(pending))
            self._driver.call(self._collect)
            pending = [j for j in pending if j in self._jobs]

    def close(self) -> None:
        """Close the worker (waiting for its copies); results left unread are dropped."""
        self._driver.run(self._worker.aclose())
        self._jobs.clear()

    # -------------------------------------------------------- inside the loop
    def _collect(self) -> None:
        for result in self._worker.get_finished_nowait():
            job = self._jobs.get(result.job_id)
            if job is None:  # not submitted through this facade
                self._ready.append(result)
                continue
            if not result.success and job.attempts <= self.retries and _retryable(result):
                job.attempts += 1
                self._retried += 1
                logger.warning(
                    "transfer %d failed (%r); retrying (attempt %d of %d)",
                    result.job_id, result.error, job.attempts, self.retries + 1,
                )
                try:
                    self._worker.transfer_async(result.job_id, job.spec)
                except TransferSpecError as exc:  # cannot happen twice, but never lose a job
                    self._finish(TransferResult(result.job_id, False, error=exc))
                continue
            self._finish(result)

    def _finish(self, result: TransferResult) -> None:
        del self._jobs[result.job_id]
        if result.success:
            self._succeeded += 1
        else:
            self._failed += 1
        self._ready.append(result)
