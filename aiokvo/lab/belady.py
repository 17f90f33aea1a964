"""Belady's offline optimum (MIN) for a request trace at a given pool size.

Every block reference of the trace, in order, is served by an oracle pool
of ``capacity`` blocks that knows the future: a missed block is kept only
if it is used again sooner than some cached block, which it then replaces
(the one used again last), and a block never used again is not kept. This
is Belady's MIN with bypass, optimal for the number of references that hit
(Belady, IBM Systems Journal 1966; Mattson et al., 1970).

For prefix traffic it is also the bound on the replay's measure (a request
hits only its longest cached prefix): no pool can serve more references
than MIN, and MIN itself keeps every cached block's prefix cached, because
a block's prefix is always used again no later than the block itself and
comes first within a request, so it is never the one dropped before it.
:func:`belady_hits` counts both and the test suite checks they agree.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["BeladyResult", "belady_hits"]


@dataclass(frozen=True)
class BeladyResult:
    """References MIN serves from its pool: ``hits`` in all, ``prefix_hits`` in prefix order."""

    capacity: int
    references: int
    hits: int
    prefix_hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.references if self.references else 0.0


def belady_hits(requests: Sequence[Sequence[Hashable]], capacity: int) -> BeladyResult:
    """Run MIN with bypass over ``requests`` (each a list of block ids, prefix first)."""
    flat = [block for request in requests for block in request]
    never = len(flat)
    next_use = [never] * len(flat)
    seen: dict[Hashable, int] = {}
    for position in range(len(flat) - 1, -1, -1):
        block = flat[position]
        next_use[position] = seen.get(block, never)
        seen[block] = position
    cached: dict[Hashable, int] = {}  # block -> position of its next use
    heap: list[int] = []  # minus those positions (stale ones skipped): furthest first
    hits = prefix_hits = 0
    position = 0
    for request in requests:
        in_prefix = True
        for block in request:
            upcoming = next_use[position]
            position += 1
            if cached.pop(block, None) is not None:
                hits += 1
                prefix_hits += in_prefix
            else:
                in_prefix = False
            if upcoming == never or capacity <= 0:
                continue
            if len(cached) >= capacity:
                while cached.get(flat[-heap[0]]) != -heap[0]:
                    heapq.heappop(heap)  # that block was used (or dropped) since
                furthest = -heap[0]
                if furthest < upcoming:
                    continue  # bypass: every cached block is needed sooner
                heapq.heappop(heap)
                del cached[flat[furthest]]
            cached[block] = upcoming
            heapq.heappush(heap, -upcoming)
    return BeladyResult(capacity, len(flat), hits, prefix_hits)
