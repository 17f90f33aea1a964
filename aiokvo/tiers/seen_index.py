"""``SeenIndex``: placement for stores whose cluster places blocks (Mooncake, any object store).

The cluster owns placement and eviction, so this index allocates nothing
(DESIGN.md, "Tiers": "an index of what it has seen and a negative cache"):

* which keys a lookup asks the store about (those before the first key in
  the negative cache) and what the answers mean;
* what a transfer's outcomes mean, block by block: good blocks are indexed;
  a block found missing or corrupt after the store said it exists goes into
  the negative cache for ``negative_ttl`` seconds (one lost segment must not
  cause a storm of doomed reads), and a corrupt one is to be removed from
  the store;
* which keys to write: not being written by us, not seen in the store within
  ``index_ttl`` seconds, not in the negative cache.

A block's place is its object name (``name_of(key)``). Events go to the
shared sink: a block this tier wrote, and the removal of a block it had
announced once a read shows it gone. Pure and synchronous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokvo.keys import OffloadKey
from aiokvo.manager.sink import EventSink
from aiokvo.specs import OffloadingEvent
from aiokvo.tiers.index import Reservation
from aiokvo.tiers.outcome import Outcome, Outcomes

__all__ = ["SeenIndex"]

NameOf = Callable[[OffloadKey], str]

_NEVER = float("-inf")
_GONE = frozenset({Outcome.MISSING, Outcome.CORRUPT})
"""Read outcomes after which the store's "exists" is not trusted for a while."""


@dataclass(slots=True)
class _Seen:
    at: float  # when the store last said (or showed) it holds the block
    ours: bool  # this tier announced it (a "stored" event went out)


class SeenIndex:
    """What a tier has seen in its store; see the module.

    ``name_of`` gives a key's object name; ``max_tracked`` bounds the index
    and the negative cache (oldest forgotten first).
    """

    def __init__(
        self,
        name_of: NameOf,
        *,
        medium: str,
        max_tracked: int = 64_000,
        negative_ttl: float = 10.0,
        index_ttl: float = 10.0,
        sink: EventSink | None = None,
    ) -> None:
        self.name_of = name_of
        self.medium = medium
        self.max_tracked = max_tracked
        self.negative_ttl = negative_ttl
        self.index_ttl = index_ttl
        self._sink = sink
        self._index: OrderedDict[OffloadKey, _Seen] = OrderedDict()
        self._negative: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> expiry
        self._writing: set[OffloadKey] = set()
        self._removals: list[str] = []
        self._removed = 0
        self.negative_hits = 0

    # ---------------------------------------------------------------- views
    def place_of(self, key: OffloadKey) -> str:
        return self.name_of(key)

    @property
    def capacity_blocks(self) -> int:
        return 0

    @property
    def used_blocks(self) -> int:
        """Keys seen in the store (bounded by ``max_tracked``)."""
        return len(self._index)

    @property
    def evictions(self) -> int:
        return 0  # the cluster's own, unseen here

    @property
    def removals(self) -> int:
        """Objects found holding wrong bytes, queued to be removed from the store."""
        return self._removed

    @property
    def writing(self) -> int:
        """Keys with a write of ours in flight."""
        return len(self._writing)

    def negative(self, now: float) -> int:
        """Keys in the negative cache now."""
        negative = self._negative
        while negative:
            key, expiry = next(iter(negative.items()))
            if expiry > now:
                break
            del negative[key]
        return len(negative)

    def is_negative(self, key: OffloadKey, now: float) -> bool:
        expiry = self._negative.get(key)
        if expiry is None:
            return False
        if expiry <= now:
            del self._negative[key]
            return False
        return True

    def is_fresh(self, key: OffloadKey, now: float) -> bool:
        """The store held ``key`` less than ``index_ttl`` seconds ago (as far as we saw)."""
        seen = self._index.get(key)
        return seen is not None and now - seen.at < self.index_ttl

    def statistics_extra(self, now: float) -> dict[str, Any]:
        return {
            "negative_hits": self.negative_hits,
            "negative_cached": self.negative(now),
            "writing_blocks": len(self._writing),
        }

    # -------------------------------------------------------------- lookups
    def lookup(self, keys: Sequence[OffloadKey], now: float) -> int:
        """Leading ``keys`` seen in the store within ``index_ttl`` (nothing is asked)."""
        n = 0
        for key in keys:
            if not self.is_fresh(key, now) or self.is_negative(key, now):
                break
            n += 1
        return n

    def to_ask(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        for i, key in enumerate(keys):
            if self.is_negative(key, now):
                self.negative_hits += 1
                return list(keys[:i])
        return list(keys)

    def answered(
        self, asked: Sequence[OffloadKey], answers: Sequence[int] | None, now: float
    ) -> int:
        n = 0
        if answers is not None:
            for key, answer in zip(asked, answers, strict=True):
                if answer != 1:
                    break
                self._see(key, now)
                n += 1
        return n

    # ------------------------------------------------------------ transfers
    def wants(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        return [
            k for k in dict.fromkeys(keys)
            if k not in self._writing and not self.is_fresh(k, now)
            and not self.is_negative(k, now)
        ]  # fmt: skip

    def reserve_read(self, keys: Sequence[OffloadKey], now: float) -> Reservation | None:
        if not keys:
            return None
        return Reservation(list(keys), [self.name_of(k) for k in keys])

    def reserve_write(self, keys: Sequence[OffloadKey], now: float) -> Reservation | None:
        new = self.wants(keys, now)
        if not new:
            return None
        self._writing.update(new)
        return Reservation(new, [self.name_of(k) for k in new])

    def commit(
        self, reservation: Reservation, outcomes: Outcomes, *, write: bool, now: float
    ) -> list[OffloadKey]:
        good: list[OffloadKey] = []
        gone: list[OffloadKey] = []
        for key, name, status in zip(
            reservation.keys, reservation.where, outcomes.status, strict=True
        ):
            if write:
                self._writing.discard(key)
            if status is Outcome.OK:
                good.append(key)
                self._see(key, now, ours=write)
            elif not write and status in _GONE:
                self._remember_absent(key, now)
                seen = self._index.pop(key, None)
                if seen is not None and seen.ours:
                    gone.append(key)
                if status is Outcome.CORRUPT:
                    self._removals.append(name)
                    self._removed += 1
        if write and good:
            self._publish(good, removed=False)
        if gone:
            self._publish(gone, removed=True)
        return good

    def adopt(self, found: Any) -> list[Any]:
        """A cluster is asked key by key; nothing is loaded at open."""
        return []

    def take_removals(self) -> list[Any]:
        removals, self._removals = self._removals, []
        return removals

    def distrust(self, now: float) -> None:
        """The cluster may have lost everything (a master restart does): re-ask."""
        for seen in self._index.values():
            seen.at = _NEVER

    # ------------------------------------------------------------ internals
    def _see(self, key: OffloadKey, now: float, *, ours: bool = False) -> None:
        index = self._index
        seen = index.get(key)
        if seen is None:
            if len(index) >= self.max_tracked:
                index.popitem(last=False)
            index[key] = _Seen(now, ours)
        else:
            seen.at = now
            seen.ours = seen.ours or ours
            index.move_to_end(key)
        self._negative.pop(key, None)

    def _remember_absent(self, key: OffloadKey, now: float) -> None:
        negative = self._negative
        negative.pop(key, None)
        if len(negative) >= self.max_tracked:
            negative.popitem(last=False)
        negative[key] = now + self.negative_ttl

    def _publish(self, keys: list[OffloadKey], *, removed: bool) -> None:
        sink = self._sink
        if sink is not None and sink.active:
            sink.publish(OffloadingEvent(keys, self.medium, removed))
