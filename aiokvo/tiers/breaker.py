"""``CircuitBreaker``: take a tier that keeps failing out of the path, try it again later.

Pure and clock-free: every call takes ``now`` (seconds on any monotonic
clock), so the same sequence of calls always gives the same decisions and a
test can drive it with a fake clock. States, as in the classic pattern:

* ``closed``: operations go through; ``failure_threshold`` failures in a row
  (errors or timeouts) open it;
* ``open``: nothing goes through for ``reset_after`` seconds, doubled for
  every failed trial in a row, up to ``max_reset_after``;
* ``half_open``: once the wait is over, exactly one operation goes through
  as a trial; its success closes the breaker, its failure opens it again.

A tier asks :meth:`available` before work that needs no slot of its own (a
lookup) and :meth:`acquire` before starting a transfer; it reports every
transfer's outcome with :meth:`record_success` / :meth:`record_failure`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from aiokvo._util import check_int
from aiokvo.errors import ConfigError

__all__ = ["BreakerState", "BreakerStatistics", "CircuitBreaker"]

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerStatistics:
    """The breaker now (its state, its failures in a row) and its counters over its life."""

    state: BreakerState = "closed"
    """``"closed"``, ``"open"`` or ``"half_open"`` now."""
    consecutive_failures: int = 0
    """Failures recorded in a row now."""
    trips: int = 0
    """Times it opened (from closed or half-open)."""
    rejected: int = 0
    """Operations turned away."""
    failures: int = 0
    """Failures recorded."""
    successes: int = 0
    """Successes recorded."""


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class CircuitBreaker:
    """Counts failures in a row and decides when a tier may be used; see the module."""

    __slots__ = (
        "_consecutive",
        "_failures",
        "_opened_at",
        "_rejected",
        "_state",
        "_successes",
        "_trial",
        "_trips",
        "_wait",
        "failure_threshold",
        "max_reset_after",
        "reset_after",
    )

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        reset_after: float = 5.0,
        max_reset_after: float = 60.0,
    ) -> None:
        self.failure_threshold = check_int("failure_threshold", failure_threshold, minimum=1)
        self.reset_after = _check_seconds("reset_after", reset_after)
        self.max_reset_after = _check_seconds("max_reset_after", max_reset_after)
        if self.max_reset_after < self.reset_after:
            raise ConfigError(
                f"max_reset_after={max_reset_after!r} is below reset_after={reset_after!r}"
            )
        self._state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._wait = self.reset_after
        self._trial = False  # a half-open trial is in flight
        self._trips = self._rejected = self._failures = self._successes = 0

    def state(self, now: float) -> BreakerState:
        """The state at ``now`` (an open breaker whose wait is over reads half-open)."""
        if self._state == "open" and now - self._opened_at >= self._wait:
            return "half_open"
        return self._state

    def available(self, now: float) -> bool:
        """Whether an operation would be let through now (changes nothing)."""
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self._trial)

    def acquire(self, now: float) -> bool:
        """Let one operation through now, or count it rejected and say no.

        In the half-open state the operation let through is the trial; no
        other is until its outcome is recorded.
        """
        state = self.state(now)
        if state == "closed":
            return True
        if state == "half_open" and not self._trial:
            self._state = "half_open"
            self._trial = True
            return True
        self._rejected += 1
        return False

    def record_success(self, now: float) -> None:
        """An operation succeeded: the breaker closes and the failure run ends."""
        self._successes += 1
        self._consecutive = 0
        if self._state != "closed":
            self._state = "closed"
            self._wait = self.reset_after
        self._trial = False

    def record_failure(self, now: float) -> None:
        """An operation failed (an error or a timeout)."""
        self._failures += 1
        self._consecutive += 1
        if self._state == "half_open" or self.state(now) == "half_open":
            self._wait = min(self._wait * 2, self.max_reset_after)  # the trial failed
            self._open(now)
        elif self._state == "closed" and self._consecutive >= self.failure_threshold:
            self._open(now)
        self._trial = False

    def reject(self) -> None:
        """Count an operation turned away by a caller that checked :meth:`available`."""
        self._rejected += 1

    def _open(self, now: float) -> None:
        self._state = "open"
        self._opened_at = now
        self._trips += 1

    def statistics(self, now: float) -> BreakerStatistics:
        return BreakerStatistics(
            state=self.state(now),
            consecutive_failures=self._consecutive,
            trips=self._trips,
            rejected=self._rejected,
            failures=self._failures,
            successes=self._successes,
        )

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self._state} failures_in_a_row={self._consecutive}>"
