"""``OffloadingWorker``: one front door for all the handlers of a process.

It routes each transfer by ``(src.medium(), dst.medium())`` and merges the
handlers' finished results into one stream, in completion order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from aiokvo._util import AsyncResource
from aiokvo.errors import (
    ConfigError,
    DuplicateJobError,
    DuplicateRouteError,
    HandlerClosedError,
    TransferSpecError,
    UnknownRouteError,
)
from aiokvo.handlers.base import OffloadingHandler
from aiokvo.handlers.stats import WorkerStatistics
from aiokvo.handlers.task import (
    DEFAULT_MAX_BUFFERED,
    DEFAULT_TAP_SIZE,
    FinishedResults,
    ResultQueue,
    ResultTap,
    TransferTask,
)
from aiokvo.specs import LoadStoreSpec, TransferResult, TransferSpec, TransferType

__all__ = ["OffloadingWorker"]

logger = logging.getLogger(__name__)


def _route_name(route: TransferType) -> str:
    return f"{route[0]}->{route[1]}"


class OffloadingWorker(FinishedResults, AsyncResource):
    """Routes transfers to the registered handlers; the same async API as a handler.

    Once registered, a handler's results go to the worker's stream (read
    them with :meth:`get_finished`), which keeps at most ``max_buffered``
    unread results (see :class:`~aiokvo.handlers.base.OffloadingHandler`).
    Job ids are unique across all handlers. The worker owns its handlers:
    :meth:`aclose` closes them.
    """

    def __init__(self, *, max_buffered: int = DEFAULT_MAX_BUFFERED) -> None:
        self._results = ResultQueue(max_buffered)
        self._routes: dict[TransferType, OffloadingHandler] = {}
        self._handlers: list[OffloadingHandler] = []
        self._live: dict[int, TransferTask] = {}
        self._closing = False
        self._close_task: asyncio.Future[None] | None = None
        self._submit_failures = 0

    # ------------------------------------------------------------- registration
    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        """Send transfers from ``src_cls``'s medium to ``dst_cls``'s to ``handler``.

        A handler belongs to one worker: registering it with a second raises
        :class:`~aiokvo.errors.HandlerOwnedError` (its results would silently
        move there), as a second handler for one route raises
        :class:`~aiokvo.errors.DuplicateRouteError`. Nothing changes either way.
        """
        if self._closing:
            raise HandlerClosedError("the worker is closed; no handler can be registered")
        if not isinstance(handler, OffloadingHandler):
            raise TypeError(f"handler must be an OffloadingHandler, got {handler!r}")
        route = (src_cls.medium(), dst_cls.medium())
        existing = self._routes.get(route)
        if existing is not None:
            raise DuplicateRouteError(
                f"route {_route_name(route)} is already handled by {existing!r}"
            )
        handler._share_results(self._results, self)  # raises if another worker has it
        self._routes[route] = handler
        if all(h is not handler for h in self._handlers):
            self._handlers.append(handler)

    @property
    def routes(self) -> dict[TransferType, OffloadingHandler]:
        """A copy of the routing table."""
        return dict(self._routes)

    def statistics(self) -> WorkerStatistics:
        """A snapshot of the worker and of every handler it routes to."""
        return WorkerStatistics(
            in_flight=sum(1 for task in self._live.values() if not task.done()),
            submit_failures=self._submit_failures,
            buffered_results=len(self._results),
            dropped_results=self._results.dropped,
            handlers=tuple(handler.statistics() for handler in self._handlers),
        )

    def tap_results(self, *, maxsize: int = DEFAULT_TAP_SIZE) -> ResultTap:
        """A bounded copy of every result from now on, whoever else reads them.

        For exporters (``aiokvo.telemetry.prometheus`` builds its transfer-time
        histograms from one): it takes nothing from :meth:`get_finished` or
        from the tasks' awaiters, and works with ``max_buffered=0``. Drain it
        with ``drain_nowait()``; ``close()`` it when done.
        """
        return self._results.tap(maxsize)

    # ---------------------------------------------------------------- transfers
    def transfer_async(self, job_id: int, spec: TransferSpec) -> TransferTask:
        """Route and enqueue one transfer; see ``OffloadingHandler.transfer_async``.

        Caller bugs (:class:`~aiokvo.errors.TransferSpecError`) and bad
        configuration (:class:`~aiokvo.errors.ConfigError`, e.g. a bad
        ``$AIOKVO_POLLER_MODE``) raise at once: retrying cannot help. Any other
        error from the handler gives an already-finished task with
        ``success=False``, and that result is reported like any other.
        """
        if self._closing:
            raise HandlerClosedError(f"the worker is closed; job_id {job_id} was not submitted")
        if not (
            isinstance(spec, tuple)
            and len(spec) == 2
            and all(isinstance(s, LoadStoreSpec) for s in spec)
        ):
            raise TransferSpecError(
                f"spec must be a (src, dst) tuple of LoadStoreSpec, got {spec!r}"
            )
        src, dst = spec
        route = (src.medium(), dst.medium())
        handler = self._routes.get(route)
        if handler is None:
            known = ", ".join(_route_name(r) for r in self._routes) or "none"
            raise UnknownRouteError(
                f"no handler for route {_route_name(route)} (registered: {known})"
            )
        previous = self._live.get(job_id)
        if previous is not None and not previous.done():
            raise DuplicateJobError(f"job_id {job_id} is still in flight on this worker")
        try:
            task = handler.transfer_async(job_id, spec)
        except (TransferSpecError, ConfigError):
            raise
        except Exception as exc:
            logger.warning("transfer %d on %s failed to submit: %r", job_id, route, exc)
            self._submit_failures += 1
            result = TransferResult(job_id=job_id, success=False, transfer_type=route, error=exc)
            self._results.put(result)
            return TransferTask.resolved(result, asyncio.get_running_loop())
        self._live[job_id] = task
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: TransferTask) -> None:
        if self._live.get(task.job_id) is task:
            del self._live[task.job_id]

    async def wait(self, job_ids: Iterable[int]) -> None:
        """Return once every live transfer in ``job_ids`` has finished (others are ignored)."""
        tasks = [self._live[j] for j in job_ids if j in self._live]
        pending = [t._future for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending)

    # ------------------------------------------------------------------ closing
    async def aclose(self) -> None:
        """Refuse new transfers, close every handler (waiting for their copies); idempotent."""
        if self._close_task is None:
            self._closing = True
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        try:
            outcomes = await asyncio.gather(
                *(h.aclose() for h in self._handlers), return_exceptions=True
            )
        finally:
            self._results.close()
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]

