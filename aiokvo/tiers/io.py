"""``StoreHandler``: one direction between the CPU pool and a tier's store.

A :class:`~aiokvo.handlers.base.SingleDirectionHandler` (FIFO, awaitable
:class:`~aiokvo.handlers.TransferTask`\\ s, statistics) whose transfers each
run as one :class:`~aiokvo.tiers.store.BlockJob` of the store on the
handler's own :class:`~aiokvo.handlers.host.dispatch.DispatchThread`, so
reads (promotions a load waits for) never queue behind write-through. The
loop only checks the transfer and enqueues it; it never runs a store's I/O
(no ``assist``: a disk can stall, a memory copy cannot).

Reads run in ``slots`` independent slots, each a thread of its own: a
promotion goes to the least busy slot (:func:`pick_slot`: never behind a
transfer running for ``STALLED_AFTER`` seconds while another slot has none)
and finishes when it ends, whatever was submitted before it, so one stalled
or large read (a request's prefetch) never holds up another request's. Writes stay one slot, in
order: a full disk keeps exactly the blocks before the first that did not
fit.

Deadlines: a transfer has ``io_timeout`` seconds from submission, queueing
included. The store starts no block after it, and a timer on the loop calls
``on_overdue(spec)`` if the job has not finished by then, so the tier's
breaker (and the loads waiting for it) can move on while a system call hangs.
Closing waits for the transfers in flight until their deadline has passed
once more; a job still stuck then is abandoned (its transfer fails, the
thread is left to finish alone) and counted, so shutdown never hangs on a
dead disk or server.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from functools import partial

from aiokvo._util import check_int
from aiokvo.errors import TransferSpecError
from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.handlers.host.dispatch import DispatchEvent, DispatchThread
from aiokvo.handlers.task import DEFAULT_MAX_BUFFERED
from aiokvo.plan.rows import check_ids_in_range
from aiokvo.runtime.poller import PollerMode
from aiokvo.specs import CPULoadStoreSpec, TransferSpec
from aiokvo.tiers.outcome import Outcome
from aiokvo.tiers.spec import TierSpec
from aiokvo.tiers.store import BlockJob, BlockStore, PoolRows

__all__ = ["STALLED_AFTER", "StoreHandler", "pick_slot"]

Overdue = Callable[[TierSpec], None]

STALLED_AFTER = 0.5
"""Seconds after which a slot's oldest transfer counts as stalled for :func:`pick_slot`.

Only a preference: a large read mistaken for a stall merely steers new reads to
the other slots."""


def pick_slot(started: Sequence[Sequence[float]], now: float) -> int:
    """The slot a new read joins, given each slot's transfers' submission times.

    A slot whose oldest transfer has run ``STALLED_AFTER`` seconds comes last (a
    hung system call would hold the new read behind it for as long as it hangs);
    then the fewest transfers; then the youngest oldest transfer (an idle slot
    first), so that ties never favour the slot most likely stuck.
    """

    def cost(slot: int) -> tuple[bool, int, float]:
        times = started[slot]
        if not times:
            return (False, 0, -math.inf)
        oldest = min(times)
        return (now - oldest >= STALLED_AFTER, len(times), -oldest)

    return min(range(len(started)), key=cost)


class StoreHandler(SingleDirectionHandler):
    """Writes (``write=True``: CPU -> store) or reads (store -> CPU) through ``store``.

    ``rows`` is the CPU pool as the store sees it; ``on_overdue`` gets the
    tier-side spec of a transfer past ``io_timeout`` (on the loop);
    ``on_abandon`` how many transfers a close had to abandon.
    """

    def __init__(
        self,
        store: BlockStore,
        rows: PoolRows,
        *,
        write: bool,
        io_timeout: float,
        on_overdue: Overdue,
        on_abandon: Callable[[int], None] | None = None,
        slots: int = 1,
        poller_mode: PollerMode | None = None,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
    ) -> None:
        medium = store.medium
        super().__init__(
            ("CPU", medium) if write else (medium, "CPU"),
            poller_mode=poller_mode,
            max_buffered=max_buffered,
        )
        slots = 1 if write else check_int("read slots", slots, minimum=1, maximum=64)
        self.ordered = slots == 1
        self.write = write
        self.store = store
        self.rows = rows
        self.io_timeout = io_timeout
        self._on_overdue = on_overdue
        self._on_abandon_cb = on_abandon
        name = f"aiokvo-{medium.lower()}-{'write' if write else 'read'}"
        self._slots = [
            DispatchThread(name if slots == 1 else f"{name}-{i}") for i in range(slots)
        ]
        self._lanes = [(type(self).__name__, d.name, id(self)) for d in self._slots]
        self._started: list[list[float]] = [[] for _ in range(slots)]  # per slot, queued
        # or running: when each was submitted
        self._dispatch = self._slots[0]
        self.abandoned = 0

    @property
    def dispatcher(self) -> DispatchThread:
        return self._dispatch

    @property
    def dispatchers(self) -> list[DispatchThread]:
        """Every slot's thread (one for writes)."""
        return list(self._slots)

    # ------------------------------------------------------------------ submit
    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        src, dst = self._check_route(spec)
        cpu, tier = (src, dst) if self.write else (dst, src)
        if not isinstance(cpu, CPULoadStoreSpec) or not isinstance(tier, TierSpec):
            raise TransferSpecError(
                f"a {self.store.medium} transfer pairs a CPULoadStoreSpec with its tier's "
                f"spec, got {spec!r}"
            )
        n = len(tier)
        if len(cpu) != n:
            raise TransferSpecError(
                f"{n} {self.store.medium} blocks need {n} CPU blocks, got {len(cpu)}"
            )
        rows = self.rows
        what = f"{self.store.medium} transfer"
        check_ids_in_range(cpu.block_ids, rows.num_blocks, "CPU block id", what)
        cpu_rows = cpu.block_ids.tolist()
        if len(set(cpu_rows)) != n:  # two blocks in one row: each checked against the other
            raise TransferSpecError(f"a {what} names a CPU block twice: {cpu_rows}")
        groups = rows.groups_of(tier.keys)
        total = sum(rows.payload[g] for g in groups)
        job = BlockJob(tier, cpu_rows, groups, time.monotonic() + self.io_timeout)
        run = partial(_run, self.store.write if self.write else self.store.read, job)
        event = DispatchEvent()  # no patience: the loop never runs a tier's I/O
        now = time.monotonic()
        slot = pick_slot(self._started, now) if len(self._slots) > 1 else 0
        self._slots[slot].submit(run, event)
        started = self._started[slot]
        started.append(now)
        timer = asyncio.get_running_loop().call_later(self.io_timeout, self._overdue, tier, event)

        def release() -> None:
            timer.cancel()
            started.remove(now)

        return Submission(
            source=event,
            transfer_size=total,
            lane=self._lanes[slot],
            elapsed=event.elapsed,
            release=release,
        )

    def _overdue(self, spec: TierSpec, event: DispatchEvent) -> None:
        if not event.query():
            self._on_overdue(spec)

    def run_later(self, work: Callable[[], object]) -> None:
        """Queue ``work`` on this handler's thread after the transfers queued now
        (housekeeping: removing bad blocks). Its errors are dropped: best effort."""

        def job() -> tuple[()]:
            with contextlib.suppress(Exception):
                work()
            return ()

        if not self.closed:
            self._dispatch.submit(job, DispatchEvent())

    # ------------------------------------------------------------------- close
    def _close_timeout(self) -> float | None:
        return self.io_timeout

    def _on_abandon(self, abandoned: int) -> None:
        self.abandoned += abandoned
        if self._on_abandon_cb is not None:
            self._on_abandon_cb(abandoned)

    async def _close_backend(self) -> None:
        # A thread stuck in a job is left to finish alone (it takes no new job).
        for dispatcher in self._slots:
            dispatcher.shutdown(wait=not self.abandoned)


def _run(io: Callable[[BlockJob], None], job: BlockJob) -> tuple[()]:
    """One transfer on the dispatch thread: the store's call, then its verdict.

    A store that raises before deciding every block leaves the rest failed
    with its error (``IO_ERROR``); a transfer with any failed block fails
    with the first error (its good blocks are still good).
    """
    outcomes = job.outcomes
    try:
        io(job)
    except Exception as exc:
        outcomes.fail_rest(Outcome.IO_ERROR, exc)
    if outcomes.error is not None:
        raise outcomes.error
    return ()
