"""``chain``: aiokvo's policy for prefix chains of KV blocks.

A KV block is only worth anything when every block before it is cached too
(a lookup stops at the first miss), requests come back as longer versions
of earlier ones (a conversation's next turn re-reads its whole history),
and most blocks are never read again. Measured on the Mooncake
conversation trace (docs/policies.md), what separates the blocks that come
back from those that do not is whether they came back before, and the wait
before they do is long (minutes, many pool-fulls of other blocks), so
recency alone (LRU) keeps the wrong ones. This policy therefore:

* keeps two LRU lists, *cold* (seen once) and *hot* (used again), and
  evicts from cold first, hot only when cold has nothing evictable;
* remembers which keys it saw recently even after evicting them, in two
  small rotating Bloom filters, so a block that comes back after its
  eviction enters hot at once instead of starting over;
* never lets a chain's level rise along it: a stored run of new keys goes
  hot only up to its first key not seen before, and a touch orders a
  request's keys so that its tail is evicted before its head, so the pool
  does not keep blocks that no lookup can reach;
* ages hot blocks by idle time, not by count: a hot block unused for one
  *horizon* loses one level (of three), and at zero goes back to the cold
  list's oldest end. The horizon is learned, not tuned: the 90th percentile
  of the reuse intervals of a 1/32 sample of keys (a SHARDS-style spatial
  sample, Waldspurger et al., FAST 2015), never less than the pool size.

The design borrows SLRU's two segments and TinyLFU's (Einziger et al.,
2017) idea of remembering evicted keys in a sketch; what is new is the
chain rule and the learned, idle-time aging. Its weak spot is popularity
that never changes: there every returning block goes hot, the long tail
crowds out the popular blocks, and ARC does better (docs/policies.md). Time is counted in block
references (keys stored or reused), so it needs no clock. Keys are hashed
with CRC-32, so decisions do not depend on Python's hash seed.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Container, Iterable, Sequence
from itertools import islice
from zlib import crc32

from aiokvo.keys import OffloadKey
from aiokvo.manager.policies._two_lists import TwoListPolicy
from aiokvo.manager.policies.base import Evicted
from aiokvo.manager.policies.lru import evictable

__all__ = ["ChainCachePolicy", "SeenFilter", "key_hashes"]

STAMP_SHIFT = 4
_STAMP_MASK = 0xFFFFFFFF  # stamps are 32-bit and compared modulo 2**32

MAX_LEVEL = 3
"""Hot blocks carry a level 1..MAX_LEVEL: how many idle horizons they survive."""

SAMPLE_MASK = 31
"""Keys whose hash is 0 modulo 32 are sampled to learn the horizon."""

SAMPLED_KEYS = 512
"""At least this many sampled keys are remembered (their last reference), and
at most half the pool's size when that is more: enough to see reuse intervals
many pools long."""

INTERVALS = 1024
"""The horizon is a quantile of this many latest sampled reuse intervals."""

HORIZON_QUANTILE = 0.9

BITS_PER_KEY = 16
"""Bloom filter bits per key expected in a horizon: with two probes about 1.4% of
never-seen keys look seen in each filter (at 8 bits it is 5%, and a pool of 1%
of the Mooncake trace then fills its hot list with them; 32 bits gain nothing)."""

_SECOND_SEED = 0x9E3779B9


def key_hashes(keys: Iterable[bytes]) -> tuple[list[int], list[int]]:
    """Two independent 32-bit hashes of each key (CRC-32 with two seeds)."""
    keys = keys if isinstance(keys, (list, tuple)) else list(keys)
    return list(map(crc32, keys)), [crc32(key, _SECOND_SEED) for key in keys]


class SeenFilter:
    """Which keys were referenced within about the last two horizons.

    Two Bloom filters (two probes, :data:`BITS_PER_KEY` bits per key added): keys go to
    the current one, lookups check both, and :meth:`rotate` drops the older
    and starts a new current one sized for the next horizon. False positives
    (a few percent) only make a block start hot.
    """

    __slots__ = ("_current", "_current_mask", "_older", "_older_mask")

    def __init__(self, expected_keys: int) -> None:
        self._current_mask, self._current = self._filter(expected_keys)
        self._older_mask, self._older = self._filter(0)  # nothing to remember yet

    @staticmethod
    def _filter(expected_keys: int) -> tuple[int, bytearray]:
        bits = 1 << 10
        while bits < BITS_PER_KEY * expected_keys:
            bits <<= 1
        return bits - 1, bytearray(bits >> 3)

    @property
    def nbytes(self) -> int:
        """Bytes held by both filters."""
        return len(self._current) + len(self._older)

    def add(self, firsts: Iterable[int], seconds: Iterable[int]) -> None:
        """Remember keys by their two hashes (see :func:`key_hashes`)."""
        mask, bits = self._current_mask, self._current
        for i, j in zip(firsts, seconds, strict=True):
            i &= mask
            j &= mask
            bits[i >> 3] |= 1 << (i & 7)
            bits[j >> 3] |= 1 << (j & 7)

    def leading_seen(self, firsts: Sequence[int], seconds: Sequence[int]) -> int:
        """How many of the leading keys were added since the rotation before last."""
        filters = ((self._current_mask, self._current), (self._older_mask, self._older))
        count = 0
        for first, second in zip(firsts, seconds, strict=True):
            for mask, bits in filters:
                i, j = first & mask, second & mask
                if bits[i >> 3] >> (i & 7) & 1 and bits[j >> 3] >> (j & 7) & 1:
                    break
            else:
                return count
            count += 1
        return count

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        firsts, seconds = key_hashes([key])
        return self.leading_seen(firsts, seconds) == 1

    def rotate(self, expected_keys: int) -> None:
        """Forget the older filter; the new current one is sized for ``expected_keys``."""
        self._older_mask, self._older = self._current_mask, self._current
        self._current_mask, self._current = self._filter(expected_keys)

    def clear(self) -> None:
        """Forget every key."""
        self._current = bytearray(len(self._current))
        self._older = bytearray(len(self._older))


class ChainCachePolicy(TwoListPolicy):
    """Cold (``_first``) and hot (``_second``) LRU lists with learned, idle-time aging."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._level = bytearray(cache_capacity)  # by block id, for hot blocks: 1..3
        # By block id: the clock at last use, in units of 2**STAMP_SHIFT references
        # (4 bytes a block; idle times are computed modulo 2**32 units).
        self._stamp = array("I", bytes(4 * cache_capacity))
        self._clock = 0
        self.horizon = max(1, cache_capacity)  # until enough intervals are sampled
        self._rotate_at = self.horizon
        self._seen = SeenFilter(self.horizon)
        self._sampled: dict[OffloadKey, int] = {}
        self._intervals: deque[int] = deque(maxlen=INTERVALS)
        self._new_intervals = 0

    # -- introspection ---------------------------------------------------------

    @property
    def cold(self) -> list[OffloadKey]:
        """Cold keys, next victim first (a copy)."""
        return list(self._first)

    @property
    def hot(self) -> list[OffloadKey]:
        """Hot keys, least recently used first (a copy)."""
        return list(self._second)

    @property
    def clock(self) -> int:
        """Block references counted so far (the policy's only notion of time)."""
        return self._clock

    def level(self, key: OffloadKey) -> int:
        """0 for a cold key, 1..3 for a hot one (``KeyError`` if not cached)."""
        block_id = self._second.get(key)
        if block_id is not None:
            return self._level[block_id]
        if key in self._first:
            return 0  # levels are kept for hot blocks only
        raise KeyError(key)

    def seen_recently(self, key: OffloadKey) -> bool:
        """Whether the history remembers ``key`` (cached or not; may say yes wrongly)."""
        return key in self._seen

    # -- changes ---------------------------------------------------------------

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        firsts, seconds = key_hashes(keys)
        # A level never rises along the chain being stored: hot up to the first new key.
        warm = self._seen.leading_seen(firsts, seconds)
        if warm:
            self._second.update(zip(keys[:warm], block_ids[:warm], strict=True))
            level, stamp, clock = self._level, self._stamp, self._clock >> STAMP_SHIFT & _STAMP_MASK
            for block_id in block_ids[:warm]:
                level[block_id] = 1
                stamp[block_id] = clock
        if warm < len(keys):
            self._first.update(zip(keys[warm:], block_ids[warm:], strict=True))
        self._remember(keys, firsts, seconds)
        self._advance(len(keys))

    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        cold, hot = self._first, self._second
        move_hot, get_hot = hot.move_to_end, hot.get
        reused: list[OffloadKey] = []
        again: list[int] = []  # block ids of hot keys used again
        promoted: list[int] = []  # block ids of cold keys used again (now hot)
        refreshed: list[int] = []  # block ids of hot keys touched by their own store
        for key in reversed(keys):  # last first: the head of the chain ends most recent
            block_id = get_hot(key)
            if block_id is not None:
                move_hot(key)
                if key in writing:
                    refreshed.append(block_id)
                else:
                    reused.append(key)
                    again.append(block_id)
            elif key in cold:
                if key in writing:  # its own store's touch: not a second use
                    cold.move_to_end(key)
                else:
                    block_id = hot[key] = cold.pop(key)
                    reused.append(key)
                    promoted.append(block_id)
        if reused:
            self._remember(reused, *key_hashes(reused))
            self._advance(len(reused))
        # Every hot key touched starts a new idle time now, so none expires below.
        level, stamp, now = self._level, self._stamp, self._clock >> STAMP_SHIFT & _STAMP_MASK
        for block_id in again:
            stamp[block_id] = now
            if level[block_id] < MAX_LEVEL:
                level[block_id] += 1
        for block_id in promoted:
            stamp[block_id] = now
            level[block_id] = 1
        for block_id in refreshed:
            stamp[block_id] = now
        self._expire()

    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        if n <= 0:
            return [], []
        from_cold = list(islice(evictable(self._first, exclude), n))
        rest = n - len(from_cold)
        from_hot = list(islice(evictable(self._second, exclude), rest)) if rest else []
        if len(from_hot) < rest:
            return None
        ids = [*map(self._first.pop, from_cold), *map(self._second.pop, from_hot)]
        return from_cold + from_hot, ids

    def clear(self) -> None:
        super().clear()
        self._seen.clear()
        self._sampled.clear()
        self._intervals.clear()
        self._new_intervals = 0
        self.horizon = max(1, self.cache_capacity)
        self._rotate_at = self._clock + self.horizon

    # -- time ------------------------------------------------------------------

    def _advance(self, references: int) -> None:
        self._clock += references
        if self._clock >= self._rotate_at:
            self._seen.rotate(self.horizon)
            self._rotate_at = self._clock + self.horizon

    def _expire(self) -> None:
        """Hot blocks idle for a horizon lose a level; at zero they turn cold (oldest)."""
        hot, cold, level, stamp = self._second, self._first, self._level, self._stamp
        span = self.horizon >> STAMP_SHIFT
        now = self._clock >> STAMP_SHIFT & _STAMP_MASK
        while hot:
            key = next(iter(hot))
            block_id = hot[key]
            if (now - stamp[block_id]) & _STAMP_MASK <= span:
                return  # idle for at most a horizon (and so is every key after it)
            if level[block_id] > 1:
                level[block_id] -= 1
                stamp[block_id] = now
                hot.move_to_end(key)
            else:
                level[block_id] = 0
                cold[key] = hot.pop(key)
                cold.move_to_end(key, last=False)

    def _remember(
        self, keys: Sequence[OffloadKey], firsts: list[int], seconds: list[int]
    ) -> None:
        """Add referenced keys to the history; learn from the sampled ones."""
        self._seen.add(firsts, seconds)
        for key, first in zip(keys, firsts, strict=True):
            if not first & SAMPLE_MASK:
                self._sample(key)

    def _sample(self, key: OffloadKey) -> None:
        sampled, clock = self._sampled, self._clock
        last = sampled.pop(key, None)
        if last is not None:
            self._intervals.append(clock - last)
            self._new_intervals += 1
            if self._new_intervals >= 64 and len(self._intervals) >= 256:
                self._new_intervals = 0
                ordered = sorted(self._intervals)
                quantile = ordered[int(len(ordered) * HORIZON_QUANTILE)]
                self.horizon = max(self.cache_capacity, quantile, 1)
        elif len(sampled) >= max(SAMPLED_KEYS, self.cache_capacity // 2):
            del sampled[next(iter(sampled))]
        sampled[key] = clock
