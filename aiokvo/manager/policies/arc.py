"""Adaptive Replacement Cache eviction (seed 5.3), without per-victim rescans.

T1 holds blocks used once, T2 blocks used again; B1 and B2 remember the
keys recently evicted from each. A touch that hits a ghost list moves
``target_t1_size`` (the share of the pool T1 may keep), and eviction takes
from T1 while T1 is at or above that target.

The seed picks each victim by scanning T1 or T2 from the front again,
skipping everything already chosen, pinned or protected. Because its
choice for victim *i+1* only depends on how many T1 victims were taken so
far, the victims are always a run of T1's evictable keys followed by a run
of T2's, so each list is walked once per call. The decisions are identical.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import islice, repeat, takewhile
from operator import or_

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies.base import CachePolicy, Evicted
from aiokvo.manager.policies.lru import evictable

__all__ = ["ARCCachePolicy"]


class ARCCachePolicy(CachePolicy):
    """Balances recency (T1) against frequency (T2), learning from ghost hits."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, int] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, int] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> int | None:
        block_id = self.t1.get(key)
        return self.t2.get(key) if block_id is None else block_id

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def items(self) -> Iterator[tuple[OffloadKey, int]]:
        return iter([*self.t1.items(), *self.t2.items()])

    def block_ids(self, keys: Sequence[OffloadKey]) -> list[int]:
        ids: list[int | None] = list(map(self.t1.get, keys, map(self.t2.get, keys)))
        if None in ids:
            raise KeyError(keys[ids.index(None)])
        return ids  # type: ignore[return-value]  # no None left

    def prefix_len(self, keys: Iterable[OffloadKey]) -> int:
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        in_t1 = map(self.t1.__contains__, keys)
        in_t2 = map(self.t2.__contains__, keys)
        return len(list(takewhile(bool, map(or_, in_t1, in_t2))))

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self.t1.update(zip(keys, block_ids, strict=True))
        for ghosts in (self.b1, self.b2):
            if ghosts:
                deque(map(ghosts.pop, keys, repeat(None)), maxlen=0)

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        missing = object()
        for key in keys:
            if self.t1.pop(key, missing) is missing:
                self.t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        t1, t2 = self.t1, self.t2
        newest_first = list(reversed(keys))
        # T moves and ghost hits never touch the same key (T and B are
        # disjoint) nor each other's state, so they can run as two passes.
        from_t1 = list(filter(t1.__contains__, newest_first))
        if from_t1:
            promoted = from_t1
            if writing:
                # A block still being written has not been *re*-used: it
                # stays in T1, refreshed to the most recent end.
                staying = [key for key in from_t1 if key in writing]
                if staying:
                    deque(map(t1.move_to_end, staying), maxlen=0)
                    promoted = [key for key in from_t1 if key not in writing]
            once = list(dict.fromkeys(promoted))
            t2.update(zip(once, map(t1.pop, once), strict=True))
        # Every key now in T2 goes to its MRU end in processing order, which
        # also orders the keys just promoted exactly as one-by-one moves would.
        deque(map(t2.move_to_end, filter(t2.__contains__, newest_first)), maxlen=0)
        b1, b2 = self.b1, self.b2
        if (b1 and not b1.keys().isdisjoint(newest_first)) or (
            b2 and not b2.keys().isdisjoint(newest_first)
        ):
            self._learn_from_ghosts(newest_first)

    def _learn_from_ghosts(self, newest_first: list[OffloadKey]) -> None:
        b1, b2 = self.b1, self.b2
        for key in newest_first:
            if key in b1:
                step = max(1, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + step, self.cache_capacity)
                b1.move_to_end(key)
            elif key in b2:
                step = max(1, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - step, 0)
                b2.move_to_end(key)

    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        if n <= 0:
            return [], []
        t1, t2 = self.t1, self.t2
        # The seed takes from T1 while the shrinking virtual T1 size stays
        # >= int(target) and T1 still has an evictable key; after that, or
        # once T1 runs dry, every remaining victim comes from T2.
        target = int(self.target_t1_size)
        from_t1_max = min(n, len(t1) - target + 1) if len(t1) >= target else 0
        victims_t1 = (
            list(islice(evictable(t1, exclude), from_t1_max)) if from_t1_max > 0 else []
        )
        rest = n - len(victims_t1)
        victims_t2 = list(islice(evictable(t2, exclude), rest)) if rest else []
        if len(victims_t2) < rest:
            return None
        ids = list(map(t1.pop, victims_t1))
        ids += map(t2.pop, victims_t2)
        self.b1.update(dict.fromkeys(victims_t1))
        self.b2.update(dict.fromkeys(victims_t2))
        for ghosts in (self.b1, self.b2):
            excess = len(ghosts) - self.cache_capacity
            if excess > 0:
                deque(map(ghosts.popitem, repeat(False, excess)), maxlen=0)
        return victims_t1 + victims_t2, ids
