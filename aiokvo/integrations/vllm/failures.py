"""Stores that failed for good, handed from a worker to the manager of its engine.

vLLM 0.32's connector has no failure channel: it asserts that every transfer
succeeded. The worker therefore reports a store that still fails after its
retries as finished (so the engine goes on), and records its CPU blocks
here; the manager of the same engine, in the same process (vLLM's one-GPU
``UniProcExecutor`` runs both roles in one process), then completes those
keys as failed when vLLM completes the job, so they are dropped and never
served. A failure this manager never hears of (a worker in another
process) still never serves wrong bytes: the worker also remembers the
blocks and refuses to load from them (docs/vllm.md, "Failures").
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable

from aiokvo.keys import OffloadKey
from aiokvo.manager.cpu import CPUOffloadingManager

__all__ = ["StoreFailures", "store_failures"]


class StoreFailures:
    """CPU block ids whose store failed, until the manager completes them."""

    def __init__(self) -> None:
        self._blocks: set[int] = set()
        self._lock = threading.Lock()
        self.consumed = 0
        """Keys the manager completed as failed because of a report."""

    @property
    def pending(self) -> bool:
        return bool(self._blocks)

    def report(self, block_ids: Iterable[int]) -> None:
        with self._lock:
            self._blocks.update(int(b) for b in block_ids)

    def take(self, manager: CPUOffloadingManager, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        """The ``keys`` being written into a reported block; those reports are consumed.

        A report that outlives its store (a job dropped by a reset) can only
        make a later store into the same block count as failed: a block is
        lost, never a wrong one served.
        """
        failed: list[OffloadKey] = []
        with self._lock:
            for key in keys:
                status = manager.block_status(key)
                if status is not None and not status.is_ready and status.block_id in self._blocks:
                    self._blocks.discard(status.block_id)
                    failed.append(key)
        self.consumed += len(failed)
        return failed

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()


_BY_ENGINE: dict[str, StoreFailures] = {}
_REGISTRY_LOCK = threading.Lock()


def store_failures(engine_id: str) -> StoreFailures:
    """The failures of engine ``engine_id`` in this process (made on first use)."""
    with _REGISTRY_LOCK:
        found = _BY_ENGINE.get(engine_id)
        if found is None:
            found = _BY_ENGINE[engine_id] = StoreFailures()
        return found
