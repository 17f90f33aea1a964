"""``Retention``: soft hints that some blocks should be evicted last (pure).

An agent's conversation that paused for a tool call will come back; an
orchestrator knows which prefix the next request needs. A hard pin would
hold the blocks however long the pause lasts and whether or not the request
comes back to this replica (SGLang merged hard TTL pins and reverted them
for this reason). A retention is soft instead:

* **evicted last**: the manager evicts every block no retention holds
  before a retained one, and among retained blocks the lower priority first;
* **never refuses a store**: when only retained blocks are left to evict,
  they go (the store always wins);
* **bounded**: the retained keys never exceed ``budget`` blocks (a fraction
  of the pool); a retention beyond it pushes out lower-priority (then
  older) ones, and one larger than the budget keeps its first keys (a
  prefix's head is what a returning request needs first);
* **decaying**: each retention ends ``ttl`` seconds after it was made,
  unless released sooner.

Every decision takes ``now`` from ``clock``, so a test drives it with a fake
clock. Keys are not checked against the pool: a retention may name blocks
not stored yet (they are retained once they are).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiokvo._util import check_int
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey, check_keys, key_sequence

__all__ = ["Retention", "RetentionStatistics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionStatistics:
    """Retention now, and since the manager was made."""

    budget_blocks: int = 0
    """The most keys retention may hold at once."""
    retained_blocks: int = 0
    """Keys some live retention holds now."""
    retentions: int = 0
    """Retentions live now."""
    made: int = 0
    """Retentions made."""
    expired: int = 0
    """Retentions that reached their ttl."""
    displaced: int = 0
    """Retentions ended early because a newer or higher one needed the budget."""
    evicted_retained: int = 0
    """Retained keys evicted anyway: a store needed the room and nothing else was left."""


@dataclass(slots=True)
class _Hold:
    keys: tuple[OffloadKey, ...]
    priority: int
    expires_at: float
    order: int


class Retention:
    """Soft retentions of a pool of blocks; see the module."""

    def __init__(self, budget: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = check_int("retention budget", budget, minimum=0)
        self._clock = clock
        self._holds: dict[int, _Hold] = {}
        self._ids = itertools.count(1)
        self._counts: dict[OffloadKey, int] = {}  # key -> holds naming it
        self._bands: list[frozenset[OffloadKey]] | None = None  # cache, by priority
        self._next_expiry = math.inf
        self.made = self.expired = self.displaced = self.evicted_retained = 0

    def retain(self, keys: Sequence[OffloadKey], *, priority: int = 0, ttl: float) -> int:
        """Retain ``keys`` at ``priority`` for ``ttl`` seconds; the retention's id.

        Raises ConfigError for a bad priority or ttl and InvalidKeyError for bad
        keys, changing nothing.
        """
        keys = key_sequence(keys, "retain")
        check_keys(keys, "retain")
        priority = check_int("priority", priority, minimum=-(1 << 31), maximum=(1 << 31) - 1)
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (
            math.isfinite(ttl) and ttl > 0
        ):  # fmt: skip
            raise ConfigError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
        now = self._clock()
        self._expire(now)
        wanted = tuple(dict.fromkeys(keys))[: self.budget]
        handle = next(self._ids)
        self._holds[handle] = _Hold(wanted, priority, now + ttl, handle)
        self._add(wanted)
        self._next_expiry = min(self._next_expiry, now + ttl)
        self.made += 1
        self._fit()
        return handle

    def release(self, handle: int) -> bool:
        """End retention ``handle`` (False: it had ended already)."""
        hold = self._holds.pop(handle, None)
        if hold is None:
            return False
        self._drop(hold.keys)
        return True

    def alive(self, handle: int) -> bool:
        self._expire(self._clock())
        return handle in self._holds

    def bands(self) -> list[frozenset[OffloadKey]]:
        """The retained keys by priority, highest first (each key in its highest band)."""
        self._expire(self._clock())
        if self._bands is None:
            best: dict[OffloadKey, int] = {}
            for hold in self._holds.values():
                for key in hold.keys:
                    if best.get(key, hold.priority - 1) < hold.priority:
                        best[key] = hold.priority
            by_priority: dict[int, set[OffloadKey]] = {}
            for key, priority in best.items():
                by_priority.setdefault(priority, set()).add(key)
            self._bands = [frozenset(by_priority[p]) for p in sorted(by_priority, reverse=True)]
        return self._bands

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def statistics(self) -> RetentionStatistics:
        self._expire(self._clock())
        return RetentionStatistics(
            budget_blocks=self.budget, retained_blocks=len(self._counts),
            retentions=len(self._holds), made=self.made, expired=self.expired,
            displaced=self.displaced, evicted_retained=self.evicted_retained,
        )  # fmt: skip

    # ------------------------------------------------------------ internals
    def _add(self, keys: Sequence[OffloadKey]) -> None:
        counts = self._counts
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        self._bands = None

    def _drop(self, keys: Sequence[OffloadKey]) -> None:
        counts = self._counts
        for key in keys:
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]
        self._bands = None

    def _expire(self, now: float) -> None:
        if now < self._next_expiry:
            return
        ended = [h for h, hold in self._holds.items() if hold.expires_at <= now]
        for handle in ended:
            self._drop(self._holds.pop(handle).keys)
        self.expired += len(ended)
        self._next_expiry = min((h.expires_at for h in self._holds.values()), default=math.inf)

    def _fit(self) -> None:
        """Drop whole retentions, lowest priority first and the oldest of a priority
        first, until the retained keys fit the budget (a new retention of low priority
        may be the one dropped: :meth:`alive` then says so)."""
        while len(self._counts) > self.budget:
            hold = min(self._holds.values(), key=lambda h: (h.priority, h.order))
            del self._holds[hold.order]
            self._drop(hold.keys)
            self.displaced += 1
