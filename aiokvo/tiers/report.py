"""How each block of one tier transfer ended: the part every tier's report shares.

A transfer has one ``success``, but a tier's blocks fail one by one (one
corrupt or vanished block among good ones is one miss, not ten), so each
tier's spec carries a report its handler fills on the I/O thread and its
state machine reads on the loop once the transfer has ended (the
completion orders the thread's writes before the loop's reads). Pure.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Generic, TypeVar

__all__ = ["BlockOutcomes"]

StatusT = TypeVar("StatusT", bound=IntEnum)


class BlockOutcomes(Generic[StatusT]):
    """``status[i]``: block ``i``'s outcome (``not_run`` until decided); ``error``: the first
    failure."""

    __slots__ = ("_not_run", "error", "status")

    def __init__(self, n: int, not_run: StatusT) -> None:
        self._not_run = not_run
        self.status: list[StatusT] = [not_run] * n
        self.error: BaseException | None = None

    def fail(self, i: int, status: StatusT, error: BaseException) -> None:
        self.status[i] = status
        if self.error is None:
            self.error = error

    def fail_range(self, lo: int, hi: int, status: StatusT, error: BaseException) -> None:
        """Mark blocks ``lo:hi`` as ``status``."""
        self.status[lo:hi] = [status] * (hi - lo)
        if self.error is None:
            self.error = error

    def fail_all(self, status: StatusT, error: BaseException) -> None:
        """Mark every block not yet decided as ``status``."""
        not_run = self._not_run
        for i, current in enumerate(self.status):
            if current is not_run:
                self.status[i] = status
        if self.error is None:
            self.error = error

    def count(self, status: StatusT) -> int:
        return sum(1 for s in self.status if s is status)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {[s.name for s in self.status]}>"
