"""Snapshots of what handlers and the worker have moved (frozen, cheap to take).

Handlers count each finished transfer with a few int and float additions on
the loop thread; everything else (in flight, buffered) is read off their
state when :meth:`statistics` is called. Exporters read these and nothing
on the hot path knows they exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokvo.specs import TransferType

__all__ = ["HandlerStatistics", "WorkerStatistics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HandlerStatistics:
    """One handler's transfers since it was made."""

    transfer_type: TransferType | None = None
    """Its direction (``("GPU", "CPU")``), or None for a handler without a single one."""
    completed: int = 0
    """Transfers finished (so ``completed + in_flight`` were submitted)."""
    failed: int = 0
    """Finished transfers that did not succeed."""
    in_flight: int = 0
    """Transfers submitted and not finished."""
    bytes: int = 0
    """Size of the *successful* transfers, summed."""
    seconds: float = 0.0
    """Copy time of the *successful* transfers, summed."""
    buffered_results: int = 0
    """Results waiting unread in the handler's own finished stream (always 0 once a
    worker took its results over)."""
    dropped_results: int = 0
    """Results discarded unread (every result, with ``max_buffered=0``)."""

    @property
    def submitted(self) -> int:
        """Transfers accepted so far (finished or not)."""
        return self.completed + self.in_flight


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStatistics:
    """The worker's own counters and each registered handler's snapshot."""

    in_flight: int = 0
    """Transfers routed and not finished."""
    submit_failures: int = 0
    """Transfers a handler failed to enqueue (reported as failed results, not raised)."""
    buffered_results: int = 0
    """Results waiting unread in the worker's merged finished stream."""
    dropped_results: int = 0
    """Results the worker's merged finished stream discarded unread."""
    handlers: tuple[HandlerStatistics, ...] = ()
    """Each registered handler's snapshot, once, in registration order."""
