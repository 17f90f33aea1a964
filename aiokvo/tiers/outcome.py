"""How each block of one tier transfer ended: one record for every tier.

A transfer has one ``success``, but a tier's blocks fail one by one (one
corrupt or vanished block among good ones is one miss, not ten). So every
tier spec carries an :class:`Outcomes` that the store fills on its I/O
thread and the tier's pure core reads on the loop once the transfer has
ended (the completion orders the thread's writes before the loop's reads).

The engine acts on the seven :class:`Outcome` values alone; a store that
wants to say more (Mooncake's error codes) names a ``cause`` per block,
which the engine only counts. Pure: no I/O, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import IntEnum

__all__ = ["STORE_FAILURES", "Outcome", "Outcomes"]


class Outcome(IntEnum):
    """How one block of a tier transfer ended."""

    NOT_RUN = 0
    """Never tried: an earlier failure, the handler closed, or it was never submitted."""
    OK = 1
    """Moved, and (on a read) verified."""
    MISSING = 2
    """Not there: never written, truncated, vanished, or no room for it in the store."""
    CORRUPT = 3
    """Read back, and the bytes are not the block's (checksum, trailer, length)."""
    STALE = 4
    """The store moved on under us (another writer replaced it, a lease ran out)."""
    IO_ERROR = 5
    """The store failed (EIO, a failed RPC, an exception in the call)."""
    TIMEOUT = 6
    """Not started: the transfer's deadline had passed."""


STORE_FAILURES = frozenset({Outcome.IO_ERROR, Outcome.TIMEOUT})
"""Outcomes that say the store itself is failing (they count against the breaker);
the others are the data's fault, and each is a miss."""


class Outcomes:
    """``status[i]``: block ``i``'s :class:`Outcome` (``NOT_RUN`` until decided);
    ``error``: the first failure; ``cause[i]``: the store's own name for a failure
    (None: the outcome says it all); ``checksums[i]``: what a write computed for
    block ``i``, for stores whose index keeps it (the disk tier's)."""

    __slots__ = ("cause", "checksums", "error", "status")

    def __init__(self, n: int) -> None:
        self.status: list[Outcome] = [Outcome.NOT_RUN] * n
        self.cause: list[str | None] = [None] * n
        self.checksums: list[int] = [0] * n
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.status)

    def ok(self, i: int) -> None:
        self.status[i] = Outcome.OK

    def ok_all(self, ids: Iterable[int]) -> None:
        """Blocks ``ids`` are good (one call for a transfer's blocks)."""
        status, good = self.status, Outcome.OK
        for i in ids:
            status[i] = good

    def all_ok(self) -> bool:
        """Every block is good (one C-level pass: the common case costs no loop)."""
        return self.status.count(Outcome.OK) == len(self.status)

    def fail(
        self, i: int, outcome: Outcome, error: BaseException, cause: str | None = None
    ) -> None:
        """Block ``i`` failed with ``outcome`` (``error`` is kept if it is the first)."""
        self.status[i] = outcome
        self.cause[i] = cause
        if self.error is None:
            self.error = error

    def fail_range(
        self, lo: int, hi: int, outcome: Outcome, error: BaseException, cause: str | None = None
    ) -> None:
        """Blocks ``lo:hi`` failed with ``outcome``."""
        for i in range(lo, hi):
            self.fail(i, outcome, error, cause)

    def fail_rest(self, outcome: Outcome, error: BaseException, cause: str | None = None) -> None:
        """Every block not decided yet failed with ``outcome``."""
        for i, status in enumerate(self.status):
            if status is Outcome.NOT_RUN:
                self.fail(i, outcome, error, cause)
        if self.error is None:
            self.error = error

    def count(self, outcome: Outcome) -> int:
        return self.status.count(outcome)

    def failures(self) -> Iterator[tuple[Outcome, str | None]]:
        """``(outcome, cause)`` of every failed block (what the engine counts)."""
        if self.all_ok():
            return
        for status, cause in zip(self.status, self.cause, strict=True):
            if status is not Outcome.OK:
                yield status, cause

    def __repr__(self) -> str:
        return f"<Outcomes {[s.name for s in self.status]}>"
