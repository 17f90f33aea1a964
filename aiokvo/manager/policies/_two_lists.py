"""Shared lookups for policies that keep their blocks in two ordered dicts.

SLRU, S3-FIFO and ``chain`` hold every cached key in exactly one of two
``OrderedDict`` (key -> block id), as ARC holds T1 and T2. One table per
block keeps the memory at one ordered-dict entry per cached block, and the
manager probes both tables inline (:meth:`membership_tables`), so lookups
cost what ARC's do. Subclasses name the table most hits land in ``_second``
so it is probed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import islice
from operator import length_hint

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies.base import CachePolicy

__all__ = ["TwoListPolicy"]


class TwoListPolicy(CachePolicy):
    """Membership, ids and prefix probes over ``_first`` and ``_second``."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._first: OrderedDict[OffloadKey, int] = OrderedDict()
        self._second: OrderedDict[OffloadKey, int] = OrderedDict()

    def get(self, key: OffloadKey) -> int | None:
        block_id = self._second.get(key)
        return self._first.get(key) if block_id is None else block_id

    def __contains__(self, key: object) -> bool:
        return key in self._second or key in self._first

    def __len__(self) -> int:
        return len(self._first) + len(self._second)

    def items(self) -> Iterator[tuple[OffloadKey, int]]:
        return iter([*self._first.items(), *self._second.items()])

    def membership_tables(self) -> tuple[Container[object], Container[object]]:
        return self._second, self._first

    def block_ids(self, keys: Sequence[OffloadKey]) -> list[int]:
        ids = list(map(self._second.get, keys))
        if None in ids:
            first = self._first
            ids = [first[key] if i is None else i for key, i in zip(keys, ids, strict=True)]
        return ids  # type: ignore[return-value]  # every None was replaced

    def uncached(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        first, second = self._first, self._second
        return [key for key in keys if key not in second and key not in first]

    def prefix_len(self, keys: Iterable[OffloadKey]) -> int:
        # As ARC's: one C-level ``all`` over the leading run in ``_second``,
        # then a loop from where it stopped.
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        first, second = self._first, self._second
        rest = iter(keys)
        if all(map(second.__contains__, rest)):
            return len(keys)
        hits = len(keys) - length_hint(rest) - 1
        for key in islice(keys, hits, None):
            if key not in second and key not in first:
                break
            hits += 1
        return hits

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        missing = object()
        for key in keys:
            if self._first.pop(key, missing) is missing:
                del self._second[key]

    def clear(self) -> None:
        self._first.clear()  # the same dicts: the manager probes them inline
        self._second.clear()
