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

With the manager's ``recency="request"`` (vLLM 0.32's rules) a request's own
stores stay in T1 and a key it reused moves T1 -> T2 once, when the request
finishes (:meth:`ARCCachePolicy.on_request_finished`), and an eviction that
finds T2 without enough evictable blocks goes on taking T1's next ones past
the target instead of failing, as 0.32 does.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import islice, repeat
from operator import length_hint

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

    def membership_tables(self) -> tuple[Container[object], Container[object]]:
        return self.t2, self.t1

    def block_ids(self, keys: Sequence[OffloadKey]) -> list[int]:
        # A block read back has usually been used before, so is in T2: probe
        # T2 for all keys in C, then fall back to T1 only for the misses.
        ids = list(map(self.t2.get, keys))
        if None in ids:
            t1 = self.t1
            ids = [t1[key] if i is None else i for key, i in zip(keys, ids, strict=True)]
        return ids  # type: ignore[return-value]  # every None was replaced

    def uncached(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        t1, t2 = self.t1, self.t2
        return [key for key in keys if key not in t2 and key not in t1]

    def prefix_len(self, keys: Iterable[OffloadKey]) -> int:
        # The leading run of T2 keys (most of a cached prefix) is probed by
        # one C-level ``all``, with no Python step between probes, so on a
        # large pool the CPU overlaps their cache misses; the list iterator
        # then says where it stopped. The rest is a loop.
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        t1, t2 = self.t1, self.t2
        rest = iter(keys)
        if all(map(t2.__contains__, rest)):
            return len(keys)
        hits = len(keys) - length_hint(rest) - 1
        for key in islice(keys, hits, None):
            if key not in t2 and key not in t1:
                break
            hits += 1
        return hits

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
        move_t2 = self.t2.move_to_end
        order = reversed(keys)
        # The keys stored by this request come last in ``keys``, so first here,
        # and are in T1: take them one by one until the first T2 key.
        for key in order:
            if key in self.t2:
                move_t2(key)
                break
            self._touch_outside_t2(key, writing)
        else:
            return
        # The rest is mostly T2: move it in C, one probe per key; a key outside
        # T2 raises KeyError, is handled alone, and ``map`` resumes after it.
        while True:
            try:
                deque(map(move_t2, order), maxlen=0)
                return
            except KeyError as missing:
                self._touch_outside_t2(missing.args[0], writing)

    def _touch_outside_t2(self, key: OffloadKey, writing: Container[OffloadKey]) -> None:
        t1, b1, b2 = self.t1, self.b1, self.b2
        if key in t1:
            if key in writing:
                # Still being written: not a second use, only refreshed.
                t1.move_to_end(key)
            else:
                self.t2[key] = t1.pop(key)  # second use: promote to "frequent"
        elif key in b1:
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
        quota = min(n, len(t1) - target + 1) if len(t1) >= target else 0
        t1_walk = evictable(t1, exclude)
        from_t1 = list(islice(t1_walk, quota)) if quota > 0 else []
        rest = n - len(from_t1)
        from_t2 = list(islice(evictable(t2, exclude), rest)) if rest else []
        past_target: list[OffloadKey] = []
        if len(from_t2) < rest:
            if self.recency != "request":
                return None
            # 0.32: T2 ran dry, so T1's next evictable keys, past the target.
            short = rest - len(from_t2)
            past_target = list(islice(t1_walk, short))
            if len(past_target) < short:
                return None
        # Victims (and their ids) in the order chosen: T1, T2, then T1 again.
        # A ghost list only needs trimming after it grew: it was trimmed then.
        victims = from_t1 + from_t2 + past_target
        ids: list[int] = [*map(t1.pop, from_t1), *map(t2.pop, from_t2), *map(t1.pop, past_target)]
        if from_t1 or past_target:
            self._remember(self.b1, from_t1 + past_target)
        if from_t2:
            self._remember(self.b2, from_t2)
        return victims, ids

    def on_request_finished(
        self,
        keys: Sequence[OffloadKey],
        insertion_only: Container[OffloadKey],
        reused: Container[OffloadKey],
        writing: Container[OffloadKey],
    ) -> None:
        # Tail to head, so the head ends most recent. A store is not a second
        # use: the request's own inserts keep their list and only move to its
        # MRU end; a reuse moves T1 -> T2 (or to T2's MRU end), once.
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in insertion_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                if key in t1:
                    t2[key] = t1.pop(key)
                elif key in t2:
                    t2.move_to_end(key)

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def _remember(self, ghosts: OrderedDict[OffloadKey, None], keys: list[OffloadKey]) -> None:
        ghosts.update(dict.fromkeys(keys))
        excess = len(ghosts) - self.cache_capacity
        if excess > 0:
            deque(map(ghosts.popitem, repeat(False, excess)), maxlen=0)
