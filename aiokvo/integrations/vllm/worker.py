"""aiokvo's handlers behind vLLM 0.32's synchronous ``OffloadingWorker`` ABC.

vLLM calls ``submit_store``, ``submit_load``, ``get_finished`` (every step)
and ``wait`` on its model-runner thread, which runs no event loop. They go to
a :class:`~aiokvo.handlers.sync.SyncOffloadingWorker`, which by default pumps
a private loop inside each call on that same thread, so each copy is
enqueued where vLLM's compute stream is current and waits for it (stores
for the KV the forward wrote, loads for the zeroing of new blocks).

Failures: vLLM asserts that ``submit_*`` returns True and that every result
succeeded, so this worker never reports a failure. A copy that fails is
retried (``SyncOffloadingWorker.retries``); one that still fails is reported
finished, logged, and counted, and then:

* a store's CPU blocks are quarantined here (no load reads them until a
  later store rewrites them) and reported to the engine's manager, in
  whatever process it runs (:mod:`aiokvo.integrations.vllm.failures`),
  which drops the keys;
* a load leaves its GPU blocks unwritten, and vLLM 0.32 offers a worker no
  way to say so (its connector reports no load errors). With
  ``on_load_failure="raise"`` the error is raised instead, stopping the
  engine as vLLM's own worker would.

A load that would read a quarantined block is not copied and counts as a
failed load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import OffloadingWorker as VllmOffloadingWorker
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult

from aiokvo.errors import AiokvoError, TransferError
from aiokvo.integrations.vllm.convert import cpu_spec_from_vllm, gpu_spec_from_vllm
from aiokvo.integrations.vllm.failures import FailureLog
from aiokvo.specs import TransferResult, TransferSpec

if TYPE_CHECKING:
    from aiokvo.handlers.sync import SyncOffloadingWorker

__all__ = ["AiokvoOffloadingWorker", "LoadFailurePolicy", "VllmWorkerStatistics"]

logger = logging.getLogger(__name__)

LoadFailurePolicy = Literal["report", "raise"]


@dataclass(frozen=True, slots=True)
class VllmWorkerStatistics:
    """A snapshot of the vLLM worker facade's counters (retries are the facade's)."""

    stores: int = 0
    loads: int = 0
    stores_failed: int = 0
    loads_failed: int = 0
    quarantined_blocks: int = 0
    retried: int = 0
    in_flight: int = 0


class AiokvoOffloadingWorker(VllmOffloadingWorker):  # type: ignore[misc]
    """vLLM's worker interface over :class:`SyncOffloadingWorker`; see the module docstring.

    ``close`` releases what the spec built (handlers, pool, loop); it is
    called once, by :meth:`shutdown`.
    """

    def __init__(
        self,
        sync: SyncOffloadingWorker,
        *,
        failure_log: FailureLog,
        close: Callable[[], None],
        on_load_failure: LoadFailurePolicy = "report",
        cpu_pool: tuple[Any, ...] | None = None,
    ) -> None:
        self.cpu_pool = cpu_pool
        """The CPU pool's tensors, one per canonical KV tensor (for inspection)."""
        self._sync = sync
        self._failures = failure_log
        self._close: Callable[[], None] | None = close
        self._on_load_failure = on_load_failure
        self._stores: dict[int, npt.NDArray[np.int64]] = {}  # job -> CPU blocks written
        self._quarantined: set[int] = set()
        self._refused: list[TransferResult] = []
        self._counts = {"stores": 0, "loads": 0, "stores_failed": 0, "loads_failed": 0}

    @property
    def sync_worker(self) -> SyncOffloadingWorker:
        return self._sync

    def statistics(self) -> VllmWorkerStatistics:
        sync = self._sync.statistics()
        return VllmWorkerStatistics(
            **self._counts,
            quarantined_blocks=len(self._quarantined),
            retried=sync.retried,
            in_flight=sync.in_flight,
        )

    # -- vLLM's interface --------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._counts["stores"] += 1
        # The blocks this store writes, known even if its specs are refused:
        # a failed store's blocks must be dropped, whatever failed.
        self._stores[job_id] = np.asarray(getattr(dst_spec, "block_ids", ()), dtype=np.int64)
        try:
            spec: TransferSpec = (gpu_spec_from_vllm(src_spec), cpu_spec_from_vllm(dst_spec))
        except AiokvoError as exc:
            self._refuse(job_id, exc)
            return True
        self._submit(job_id, spec)
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        # vLLM 0.33 marks loads it waits for within the step ``expedited``: every
        # aiokvo load is enqueued at once, in order, so nothing queues ahead of it.
        self._counts["loads"] += 1
        try:
            src = cpu_spec_from_vllm(src_spec)
            spec: TransferSpec = (src, gpu_spec_from_vllm(dst_spec))
        except AiokvoError as exc:
            self._refuse(job_id, exc)
            return True
        if self._quarantined and not self._quarantined.isdisjoint(src.block_ids.tolist()):
            self._refuse(job_id, TransferError(
                f"load job {job_id} would read CPU blocks a failed store left unwritten"
            ))
            return True
        self._submit(job_id, spec)
        return True

    def get_finished(self) -> list[Any]:
        results = self._sync.get_finished()
        if self._refused:
            results += self._refused
            self._refused = []
        return [self._report(result) for result in results]

    def wait(self, job_ids: set[int]) -> None:
        self._sync.wait(job_ids)

    def shutdown(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            try:
                close()
            finally:
                self._failures.close()

    # -- internals -------------------------------------------------------------
    def _submit(self, job_id: int, spec: TransferSpec) -> None:
        try:
            self._sync.submit(job_id, spec)
        except AiokvoError as exc:  # a caller bug (bad ids, duplicate job): never a crash
            self._refuse(job_id, exc)

    def _refuse(self, job_id: int, error: BaseException) -> None:
        """A transfer that was never enqueued: reported failed at the next poll."""
        self._refused.append(TransferResult(job_id, False, error=error))

    def _report(self, result: TransferResult) -> Any:
        blocks = self._stores.pop(result.job_id, None)
        if result.success:
            if blocks is not None and self._quarantined:
                self._quarantined.difference_update(blocks.tolist())  # rewritten
            return VllmTransferResult(
                job_id=result.job_id,
                success=True,
                transfer_size=result.transfer_size,
                transfer_time=result.transfer_time,
            )
        if blocks is not None:
            self._counts["stores_failed"] += 1
            ids = blocks.tolist()
            self._quarantined.update(ids)
            self._failures.append(ids)  # before vLLM hears the job finished
            logger.error(
                "aiokvo: store job %d failed after retries (%r); its %d CPU blocks are "
                "dropped, never served", result.job_id, result.error, len(ids),
            )
        else:
            self._counts["loads_failed"] += 1
            logger.error(
                "aiokvo: load job %d failed after retries (%r); its GPU blocks were not "
                "written, and vLLM 0.32 has no way to be told", result.job_id, result.error,
            )
            if self._on_load_failure == "raise":
                raise TransferError(f"load job {result.job_id} failed: {result.error!r}")
        # Reported finished so the engine goes on; no size or time, so vLLM's
        # transfer stats do not count it.
        return VllmTransferResult(job_id=result.job_id, success=True)
