"""Shared lookups for policies that keep every cached block in one dict.

LRU (an ``OrderedDict`` in recency order) and SIEVE (a plain ``dict`` beside
its queue) both map key -> block id in a single table ``_blocks``; the
manager probes it inline (:meth:`membership_tables`), and the probes below
stay single C-level passes over it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from itertools import filterfalse
from operator import length_hint

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies.base import CachePolicy

__all__ = ["OneTablePolicy"]


class OneTablePolicy(CachePolicy):
    """Membership, ids and prefix probes over ``_blocks`` (set by the subclass)."""

    _blocks: dict[OffloadKey, int]

    def get(self, key: OffloadKey) -> int | None:
        return self._blocks.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def membership_tables(self) -> tuple[Container[object], Container[object]]:
        return self._blocks, frozenset()

    def block_ids(self, keys: Sequence[OffloadKey]) -> list[int]:
        return list(map(self._blocks.__getitem__, keys))

    def uncached(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        return list(filterfalse(self._blocks.__contains__, keys))

    def prefix_len(self, keys: Iterable[OffloadKey]) -> int:
        # ``all`` stops at the first miss; the list iterator then says how
        # many keys it did not reach. Cheaper than collecting a takewhile.
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        rest = iter(keys)
        if all(map(self._blocks.__contains__, rest)):
            return len(keys)
        return len(keys) - length_hint(rest) - 1
