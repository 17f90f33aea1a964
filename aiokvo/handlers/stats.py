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
    """One handler's transfers since it was made.

    ``transfer_type`` is its direction (``("GPU", "CPU")``), or None for a
    handler that does not have a single one. ``completed`` transfers finished,
    ``failed`` of them unsuccessfully; ``in_flight`` are submitted and not
    finished (so ``completed + in_flight`` were submitted). ``bytes`` and
    ``seconds`` add up the size and copy time of the *successful* transfers.
    ``buffered_results`` wait unread in the handler's own finished stream
    (always 0 once a worker took its results over) and ``dropped_results``
    were discarded unread (every result, with ``max_buffered=0``).
    """

    transfer_type: TransferType | None = None
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    bytes: int = 0
    seconds: float = 0.0
    buffered_results: int = 0
    dropped_results: int = 0

    @property
    def submitted(self) -> int:
        """Transfers accepted so far (finished or not)."""
        return self.completed + self.in_flight


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStatistics:
    """The worker's own counters and each registered handler's snapshot.

    ``in_flight`` transfers routed and not finished; ``submit_failures``
    transfers a handler failed to enqueue (reported as failed results, not
    raised). ``buffered_results`` / ``dropped_results`` describe the worker's
    merged finished stream. ``handlers`` lists each handler once, in
    registration order.
    """

    in_flight: int = 0
    submit_failures: int = 0
    buffered_results: int = 0
    dropped_results: int = 0
    handlers: tuple[HandlerStatistics, ...] = ()
