"""Saying why stores are refused: once per burst, the first time as a warning with numbers.

A store is refused when the CPU pool cannot make room: every block it could
evict is held by a store being written, a load, a lease, or a tier's
write-through in flight (which pins its blocks until the tier write ends).
That is a sizing problem, not a failed copy, and it comes in bursts, so the
Offloader says it once per burst, naming the pool's numbers, rather than once
per call; the first burst is a WARNING that points at the sizing rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PoolPressure", "RefusalLog"]

logger = logging.getLogger("aiokvo.offloader")

SIZING = "docs/tiers.md, 'Sizing the CPU pool'"


@dataclass(frozen=True, slots=True)
class PoolPressure:
    """Where the pool's blocks were when a store was refused."""

    num_blocks: int
    writing_blocks: int
    pinned_blocks: int
    pinned_by_tier_writes: int
    write_limit: int
    """CPU blocks tier write-through may pin at once (0 without tiers)."""
    stores_in_flight: int

    def describe(self) -> str:
        text = (
            f"no room in the CPU pool of {self.num_blocks} blocks: {self.writing_blocks} being "
            f"written by {self.stores_in_flight} stores in flight, {self.pinned_blocks} pinned"
        )
        if not self.write_limit:
            return f"{text} by loads and leases"
        tier = min(self.pinned_by_tier_writes, self.pinned_blocks)
        return (
            f"{text} ({tier} by tier write-through in flight, which may pin up to "
            f"{self.write_limit}; {self.pinned_blocks - tier} by loads and leases)"
        )

    def rule(self) -> str:
        """The sizing rule with this pool's write-through limit in it."""
        need = "requests in flight x blocks per request"
        if not self.write_limit:
            return f"the pool needs {need} blocks"
        return (
            f"tier writes pin their blocks until written, so the pool needs ({need}) + "
            f"{self.write_limit} blocks (max_write_blocks)"
        )


class RefusalLog:
    """One log line per burst of refused stores (a burst ends when a store gets room)."""

    __slots__ = ("_in_burst", "bursts")

    def __init__(self) -> None:
        self._in_burst = False
        self.bursts = 0

    def room(self) -> None:
        """A store reserved its keys: the burst, if any, is over."""
        self._in_burst = False

    def refused(self, keys: int, pressure_now: Callable[[], PoolPressure]) -> None:
        """A store of ``keys`` keys was refused; ``pressure_now`` is asked only to log."""
        if self._in_burst:
            return
        self._in_burst = True
        self.bursts += 1
        pressure = pressure_now()
        what = f"Offloader.store refused {keys} key{'s' if keys != 1 else ''}: "
        if self.bursts == 1:
            logger.warning(
                "%s%s. Stores are refused until blocks free up (StoreResult.refused, "
                "statistics().stores_refused); logged once per burst. Sizing: %s (%s).",
                what, pressure.describe(), pressure.rule(), SIZING,
            )
        else:
            logger.info("%s%s (refusal burst %d).", what, pressure.describe(), self.bursts)
