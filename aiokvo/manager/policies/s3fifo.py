"""S3-FIFO eviction (Yang, Zhang, Qiu, Yue and Rashmi, SOSP 2023).

Three FIFO queues: a *small* one (10% of the pool) that every new block
enters, a *main* one for the rest, and a *ghost* queue that remembers the
keys recently dropped from the small one (as many keys as main holds, no
data). Each block has a 2-bit use count. Eviction takes from the small
queue while it holds its share: a block used there moves to main, one never
used is dropped and remembered as a ghost. Main is a CLOCK of counts: a
block with a count left is requeued with one less, one with none is dropped.
A new block whose key is a ghost goes straight to main. Most blocks are used
once; the small queue filters them out after a short stay, which is the
paper's point ("quick demotion"), while main keeps what proved useful.

Adapted to a pool filled in batches: ``evict(n)`` produces exactly ``n``
victims (moving small -> main takes no extra eviction), and it first counts
the evictable blocks so that a call that cannot succeed changes nothing.
A touch of a block still being written is not a use (as in ARC).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterator, Sequence
from itertools import islice, repeat

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies._two_lists import TwoListPolicy
from aiokvo.manager.policies.base import Evicted
from aiokvo.manager.policies.lru import evictable

__all__ = ["S3FIFOCachePolicy", "count_evictable"]

SMALL_SHARE = 0.1
"""The small queue's share of the pool (the paper's 10%)."""

MAX_USES = 3
"""The use count saturates here (two bits)."""


def count_evictable(policy: TwoListPolicy, exclude: Sequence[Container[OffloadKey]]) -> int:
    """How many cached keys are in none of ``exclude``.

    The manager's exclusions (the call's keys, blocks written or read) are
    small dicts and sets: iterating them is cheap. A container that cannot
    be iterated makes this walk the whole pool instead.
    """
    held: set[OffloadKey] = set()
    for container in exclude:
        if not isinstance(container, (dict, set, frozenset, list, tuple)):
            return sum(1 for _ in evictable((k for k, _ in policy.items()), exclude))
        held.update(key for key in container if key in policy)
    return len(policy) - len(held)


class S3FIFOCachePolicy(TwoListPolicy):
    """Small (``_first``), main (``_second``) and ghost FIFO queues, oldest first."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.small_capacity = max(1, int(cache_capacity * SMALL_SHARE))
        self.ghost_capacity = max(0, cache_capacity - self.small_capacity)
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._uses = bytearray(cache_capacity)  # by block id, 0..MAX_USES

    @property
    def small(self) -> list[OffloadKey]:
        """Keys in the small queue, oldest first (a copy)."""
        return list(self._first)

    @property
    def main(self) -> list[OffloadKey]:
        """Keys in the main queue, oldest first (a copy)."""
        return list(self._second)

    @property
    def ghosts(self) -> list[OffloadKey]:
        """Remembered keys, oldest first (a copy)."""
        return list(self._ghost)

    def uses(self, key: OffloadKey) -> int:
        """``key``'s use count (``KeyError`` if not cached)."""
        block_id = self.get(key)
        if block_id is None:
            raise KeyError(key)
        return self._uses[block_id]

    def items(self) -> Iterator[tuple[OffloadKey, int]]:
        return iter([*self._first.items(), *self._second.items()])

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        ghost, small, main, uses = self._ghost, self._first, self._second, self._uses
        for block_id in block_ids:
            uses[block_id] = 0
        if not ghost or not any(map(ghost.__contains__, keys)):
            small.update(zip(keys, block_ids, strict=True))
            return
        for key, block_id in zip(keys, block_ids, strict=True):
            if key in ghost:
                del ghost[key]
                main[key] = block_id
            else:
                small[key] = block_id

    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        uses, in_main, in_small = self._uses, self._second.get, self._first.get
        for key in keys:
            block_id = in_main(key)
            if block_id is None:
                block_id = in_small(key)
                if block_id is None:
                    continue
            if uses[block_id] < MAX_USES and key not in writing:
                uses[block_id] += 1

    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        if n <= 0:
            return [], []
        if count_evictable(self, exclude) < n:
            return None
        small, main, uses = self._first, self._second, self._uses
        victims: list[OffloadKey] = []
        ids: list[int] = []
        dropped_small: list[OffloadKey] = []
        while len(victims) < n:
            # Candidates come in batches (the queues change as they are handled).
            need = n - len(victims)
            if len(small) >= self.small_capacity:
                batch = list(islice(evictable(small, exclude), need))
                for key in batch:
                    if len(small) < self.small_capacity:
                        break
                    block_id = small.pop(key)
                    if uses[block_id]:
                        main[key] = block_id  # used while on probation: promote
                    else:
                        victims.append(key)
                        ids.append(block_id)
                        dropped_small.append(key)
                if batch:
                    continue
            batch = list(islice(evictable(main, exclude), need))
            if not batch:  # nothing evictable in main: the small queue's, whatever its size
                batch = list(islice(evictable(small, exclude), need))
                for key in batch:
                    block_id = small.pop(key)
                    if uses[block_id]:
                        main[key] = block_id
                    else:
                        victims.append(key)
                        ids.append(block_id)
                        dropped_small.append(key)
                continue
            for key in batch:
                block_id = main[key]
                if uses[block_id]:
                    uses[block_id] -= 1
                    main.move_to_end(key)  # another turn, one use fewer
                else:
                    victims.append(key)
                    ids.append(main.pop(key))
        if dropped_small:
            self._remember(dropped_small)
        return victims, ids

    def clear(self) -> None:
        super().clear()
        self._ghost.clear()

    def _remember(self, keys: list[OffloadKey]) -> None:
        ghost = self._ghost
        ghost.update(dict.fromkeys(keys))
        excess = len(ghost) - self.ghost_capacity
        if excess > 0:
            deque(map(ghost.popitem, repeat(False, excess)), maxlen=0)
