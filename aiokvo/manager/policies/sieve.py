"""SIEVE eviction (Zhang, Yang, Yue, Vigfusson and Rashmi, NSDI 2024).

Blocks sit in one FIFO queue, oldest first, and each carries a *visited*
bit that a use sets. A hand walks the queue from the oldest block towards
the newest, wrapping around: a visited block has its bit cleared and stays
where it is; the first block found unvisited is evicted, and the hand
stays there for the next eviction. Unlike CLOCK, survivors are never moved
to the head, so new blocks (most of which are never used again) are sifted
out quickly while popular ones stay behind the hand. It is as simple as
FIFO and, on web traces, matches or beats LRU and ARC.

The queue is a list with holes left by evictions, compacted when they
outnumber the blocks; the visited bits live in a ``bytearray`` indexed by
block id (one byte per block). A touch of a block still being written is
not a use (as in ARC), so a store followed by its own touch sets no bit.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies._one_table import OneTablePolicy
from aiokvo.manager.policies.base import Evicted

__all__ = ["SIEVECachePolicy"]


class SIEVECachePolicy(OneTablePolicy):
    """FIFO with visited bits and a hand that sifts unused blocks out."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: dict[OffloadKey, int] = {}
        self._queue: list[OffloadKey | None] = []  # oldest first; None is a hole
        self._hand = 0  # index of the next block the hand looks at
        self._visited = bytearray(cache_capacity)  # by block id

    # -- lookups ---------------------------------------------------------------

    def items(self) -> Iterator[tuple[OffloadKey, int]]:
        # In the order the hand will reach them (visited ones get a second chance).
        hand, queue, blocks = self._hand, self._queue, self._blocks
        order = [key for key in (*queue[hand:], *queue[:hand]) if key is not None]
        return iter([(key, blocks[key]) for key in order])

    def visited(self, key: OffloadKey) -> bool:
        """Whether ``key``'s visited bit is set (``KeyError`` if not cached)."""
        return bool(self._visited[self._blocks[key]])

    # -- changes ---------------------------------------------------------------

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._blocks.update(zip(keys, block_ids, strict=True))
        visited = self._visited
        for block_id in block_ids:
            visited[block_id] = 0
        self._queue += keys

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        gone = set(keys)
        for key in gone:
            del self._blocks[key]
        # Rare (failed stores): rebuild the queue, keeping the hand on the same block.
        queue = self._queue
        before = sum(1 for key in queue[: self._hand] if key is not None and key not in gone)
        self._queue = [key for key in queue if key is not None and key not in gone]
        self._hand = before

    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        blocks, visited = self._blocks, self._visited
        for key in keys:
            block_id = blocks.get(key)
            if block_id is not None and key not in writing:
                visited[block_id] = 1

    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        if n <= 0:
            return [], []
        queue, blocks, visited = self._queue, self._blocks, self._visited
        hand, size = self._hand, len(queue)
        if len(blocks) < n:
            return None
        victims: list[OffloadKey] = []
        at: list[int] = []
        cleared: list[int] = []  # block ids whose bit this call cleared, to undo
        # Two full turns clear every bit the first turn found set; a third finds nothing new.
        budget = 2 * size + 1
        while len(victims) < n and budget > 0:
            budget -= 1
            if hand >= size:
                hand = 0
            key = queue[hand]
            hand += 1
            if key is None or any(key in container for container in exclude):
                continue
            block_id = blocks[key]
            if visited[block_id]:
                visited[block_id] = 0
                cleared.append(block_id)
                continue
            victims.append(key)
            at.append(hand - 1)
            # Holes at the hand are cheap: mark now, so a wrap does not find it again.
            queue[hand - 1] = None
        if len(victims) < n:
            for index, key in zip(at, victims, strict=True):
                queue[index] = key
            for block_id in cleared:
                visited[block_id] = 1
            return None
        self._hand = hand
        ids = list(map(blocks.pop, victims))
        if len(queue) > 2 * len(blocks) + 16:
            self._compact()
        return victims, ids

    def clear(self) -> None:
        self._blocks.clear()
        self._queue.clear()
        self._hand = 0

    def _compact(self) -> None:
        queue, hand = self._queue, self._hand
        before: list[OffloadKey | None] = [key for key in queue[:hand] if key is not None]
        self._queue = before + [key for key in queue[hand:] if key is not None]
        self._hand = len(before)
