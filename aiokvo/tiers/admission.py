"""``Admission``: write a block to a tier once it has been offered ``admit_after`` times.

Write-through costs tier bandwidth and space for every block the CPU pool
takes; most blocks of a prefix-reuse workload are used once. The filter
counts offers per key (a ``store`` naming the key is one offer) and admits a
key on its ``admit_after``-th offer and every one after; ``admit_after=1``
admits everything and counts nothing. The counter is bounded like the CPU
manager's reuse filter: when full, the key offered least recently is
forgotten. Pure and synchronous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from aiokvo._util import check_int
from aiokvo.keys import OffloadKey

__all__ = ["Admission"]


class Admission:
    """Offer counts per key, bounded to ``max_tracked`` keys."""

    __slots__ = ("_counts", "_offered", "admit_after", "max_tracked")

    def __init__(self, admit_after: int = 1, max_tracked: int = 64_000) -> None:
        self.admit_after = check_int("admit_after", admit_after, minimum=1)
        self.max_tracked = check_int("max_tracked", max_tracked, minimum=1)
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._offered = 0

    @property
    def tracked(self) -> int:
        """Keys with a count now."""
        return len(self._counts)

    @property
    def offered(self) -> int:
        """Offers counted so far (keys, summed over calls)."""
        return self._offered

    def offer(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Count one offer of each of ``keys`` (once per call); those now admitted, in order."""
        keys = list(dict.fromkeys(keys))
        self._offered += len(keys)
        threshold = self.admit_after
        if threshold == 1:
            return keys
        counts, limit = self._counts, self.max_tracked
        admitted: list[OffloadKey] = []
        for key in keys:
            seen = counts.get(key)
            if seen is None:
                if len(counts) >= limit:
                    counts.popitem(last=False)
                seen = 0
            else:
                counts.move_to_end(key)
            counts[key] = seen + 1
            if seen + 1 >= threshold:
                admitted.append(key)
        return admitted
