"""Segmented LRU (Karedla, Love and Wherry, IEEE Computer 1994).

New blocks enter a *probationary* LRU segment; a block used again moves to
a *protected* segment, which may hold at most 80% of the pool. When the
protected segment overflows, its least recently used block goes back to
the most recent end of probation, so it must be used once more to stay. Victims
come from probation's cold end first, then from protection's. One scan of
blocks used once can flush probation but never the protected blocks, which
is what plain LRU lacks; unlike LFU it forgets quickly, because protection
is bounded by size rather than by counts.

As in ARC, a touch of a block still being written is not a second use: it
only refreshes the block within probation.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from itertools import islice

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies._two_lists import TwoListPolicy
from aiokvo.manager.policies.base import Evicted
from aiokvo.manager.policies.lru import evictable

__all__ = ["SLRUCachePolicy"]

PROTECTED_SHARE = 0.8
"""The protected segment's share of the pool (the paper's usual 80/20 split)."""


class SLRUCachePolicy(TwoListPolicy):
    """Probation (``_first``) and a protected segment (``_second``), both LRU first."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.protected_capacity = int(cache_capacity * PROTECTED_SHARE)

    @property
    def probation(self) -> Sequence[OffloadKey]:
        """Probationary keys, least recently used first (a copy)."""
        return list(self._first)

    @property
    def protected(self) -> Sequence[OffloadKey]:
        """Protected keys, least recently used first (a copy)."""
        return list(self._second)

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._first.update(zip(keys, block_ids, strict=True))

    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        probation, protected = self._first, self._second
        for key in reversed(keys):  # last first: the first key ends most recent
            if key in protected:
                protected.move_to_end(key)
            elif key in probation:
                if key in writing:
                    probation.move_to_end(key)
                else:
                    protected[key] = probation.pop(key)
        excess = len(protected) - self.protected_capacity
        if excess > 0:
            demoted = list(islice(protected, excess))
            probation.update(zip(demoted, map(protected.pop, demoted), strict=True))

    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        if n <= 0:
            return [], []
        from_probation = list(islice(evictable(self._first, exclude), n))
        rest = n - len(from_probation)
        from_protected = list(islice(evictable(self._second, exclude), rest)) if rest else []
        if len(from_protected) < rest:
            return None
        ids = [*map(self._first.pop, from_probation), *map(self._second.pop, from_protected)]
        return from_probation + from_protected, ids
