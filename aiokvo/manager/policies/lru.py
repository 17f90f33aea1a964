"""Least-recently-used eviction (seed 5.2), one ``OrderedDict`` deep.

The ``OrderedDict`` maps key to block id, least recently used first. Its C
linked list gives O(1) move-to-end and O(1) access to the oldest entry even
after millions of evictions; a plain ``dict`` would be smaller, but its
iteration has to skip every deleted slot left at the front, so the eviction
walk would slow down as the pool grows (see docs/manager.md).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import filterfalse, islice

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies._one_table import OneTablePolicy
from aiokvo.manager.policies.base import Evicted

__all__ = ["LRUCachePolicy", "evictable"]


def evictable(
    keys: Iterable[OffloadKey], exclude: Sequence[Container[OffloadKey]]
) -> Iterator[OffloadKey]:
    """Lazily yield the ``keys`` found in none of ``exclude``, in order.

    Built from nested ``filterfalse`` so the walk runs in C and stops as
    soon as the caller has taken what it needs.
    """
    it: Iterator[OffloadKey] = iter(keys)
    for container in exclude:
        it = filterfalse(container.__contains__, it)
    return it


class LRUCachePolicy(OneTablePolicy):
    """Evicts the least recently used idle block."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: OrderedDict[OffloadKey, int] = OrderedDict()

    def items(self) -> Iterator[tuple[OffloadKey, int]]:
        return iter(list(self._blocks.items()))

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._blocks.update(zip(keys, block_ids, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        deque(map(self._blocks.__delitem__, keys), maxlen=0)

    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        # Last key first, so the first key ends up most recent. One probe per
        # key: ``move_to_end`` itself finds the key, and an absent key (its
        # KeyError) is skipped by resuming the same iterator after it.
        move = self._blocks.move_to_end
        order = reversed(keys)
        while True:
            try:
                deque(map(move, order), maxlen=0)
                return
            except KeyError:
                continue

    def clear(self) -> None:
        self._blocks.clear()  # the same dict: the manager probes it inline

    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        if n <= 0:
            return [], []
        victims = list(islice(evictable(self._blocks, exclude), n))
        if len(victims) < n:
            return None
        return victims, list(map(self._blocks.pop, victims))
