"""The tier handlers' common shape: blocking I/O as in-order jobs, each with a deadline.

A tier's handler (disk, Mooncake) never runs I/O on the loop: every
transfer becomes one job on a :class:`~aiokvo.handlers.host.DispatchThread`
(the handler's own unless one is shared), and a timer on the loop calls
``on_overdue(spec)`` if the job has not finished after ``io_timeout``
seconds, so that the tier's breaker and its waiting loads can move on while
the blocking call runs out. The subclass checks a transfer, builds its job
and says how many bytes it moves; this class does the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.host.dispatch import DispatchEvent, DispatchThread, Work
from aiokvo.runtime.poller import PollerMode

__all__ = ["TierIOHandler"]

SpecT = TypeVar("SpecT")


class TierIOHandler(SingleDirectionHandler, Generic[SpecT]):
    """One direction between the CPU pool and a tier, its I/O on a dispatch thread.

    ``route`` is the ``(src, dst)`` media pair; ``thread_name`` names the
    handler's own dispatch thread (and its lane); ``on_overdue`` gets the
    tier-side spec of a transfer past ``io_timeout`` (on the loop).
    """

    def __init__(
        self,
        route: tuple[str, str],
        *,
        thread_name: str,
        io_timeout: float,
        on_overdue: Callable[[SpecT], None],
        dispatcher: DispatchThread | None,
        poller_mode: PollerMode | None,
        max_buffered: int,
    ) -> None:
        super().__init__(route, poller_mode=poller_mode, max_buffered=max_buffered)
        self.io_timeout = io_timeout
        self._on_overdue = on_overdue
        self._owns_dispatcher = dispatcher is None
        self._dispatch = dispatcher or DispatchThread(thread_name)
        self._lane = (type(self).__name__, thread_name, id(self))

    @property
    def dispatcher(self) -> DispatchThread:
        return self._dispatch

    def _dispatch_job(
        self, job: Work, spec: SpecT, transfer_size: int
    ) -> Submission:
        """Queue ``job`` (after every earlier one) with a deadline for ``spec``'s transfer."""
        event = DispatchEvent()  # no patience: the loop never runs a tier's I/O
        self._dispatch.submit(job, event)
        timer = asyncio.get_running_loop().call_later(self.io_timeout, self._overdue, spec, event)
        return Submission(
            source=event,
            transfer_size=transfer_size,
            lane=self._lane,
            elapsed=event.elapsed,
            release=timer.cancel,
        )

    def _overdue(self, spec: SpecT, event: DispatchEvent) -> None:
        if not event.query():
            self._on_overdue(spec)

    def _shutdown_dispatcher(self) -> None:
        """Stop the dispatch thread if it is the handler's own (a shared one is its owner's)."""
        if self._owns_dispatcher:
            self._dispatch.shutdown()
