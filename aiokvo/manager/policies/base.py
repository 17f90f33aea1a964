"""The cache-policy interface: which cached block to drop next.

A policy owns the mapping from key to CPU block id *in its own order* (for
LRU, least recently used first). The manager owns everything else: the pool
of free ids, which blocks are being written and which are pinned by readers.

The interface is batch-shaped (one call per manager operation, never one
per key) so that built-in policies can do their work in C-level builtins
(``map``, ``filter``, ``dict.update``) instead of Python loops; that is
where most of the manager's speed comes from. A third-party policy can be
written naively against it and plugged in by module path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import takewhile
from typing import Literal, TypeAlias

from aiokvo.keys import OffloadKey

__all__ = ["RECENCY_MODES", "WRITING", "BlockStatus", "CachePolicy", "Evicted", "Recency"]

Recency: TypeAlias = Literal["touch", "request"]
"""When a manager tells its policy that keys were used.

``"touch"`` (the seed's): whenever the caller calls ``touch``, typically on
every lookup hit. ``"request"`` (vLLM 0.32's): once per request, when it
finishes, over the keys it loaded or offered in prefix order; a request's own
stores are not a second use. See docs/manager.md, "Recency modes"."""

RECENCY_MODES: tuple[Recency, ...] = ("touch", "request")

WRITING = -1
"""``ref_cnt`` of a block whose data is still being copied in."""

Evicted = tuple[list[OffloadKey], list[int]]
"""Victims as ``(keys, block_ids)``, two parallel lists in the order chosen."""


class BlockStatus:
    """A read-only snapshot of one cached block: its id and reference count.

    ``ref_cnt`` is -1 while the block is being written, 0 when it is ready
    and idle, and the number of pending loads when it is being read. The
    manager does not keep one of these per block (that would cost ~100
    bytes each); it builds one on request, e.g. from
    :meth:`CPUOffloadingManager.block_status`.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int, ref_cnt: int = WRITING) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt

    @property
    def is_ready(self) -> bool:
        """True once the data is complete and may be read."""
        return self.ref_cnt >= 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockStatus):
            return NotImplemented
        return (self.block_id, self.ref_cnt) == (other.block_id, other.ref_cnt)

    def __hash__(self) -> int:
        return hash((self.block_id, self.ref_cnt))

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class CachePolicy(ABC):
    """Orders the cached blocks and chooses eviction victims.

    Contract with :class:`~aiokvo.manager.cpu.CPUOffloadingManager`:

    * ``insert`` receives keys that are not cached, with fresh block ids;
      those blocks are being written until the manager says otherwise.
    * ``evict(n, exclude)`` either removes exactly ``n`` keys and returns
      them and their block ids as two parallel lists, or returns None and changes *nothing*
      (adaptive state included). A key contained in any container of
      ``exclude`` (the call's own keys, blocks being written, blocks being
      read) must not be chosen.
    * ``touch(keys, writing)`` marks keys as used, processing them from the
      last to the first so the first key ends up most recent; keys that are
      not cached are ignored (or, for ARC, consulted in the ghost lists).
    * ``remove`` drops keys whose store failed.

    ``cache_capacity`` is the pool size; policies that keep history (ARC's
    ghost lists) bound it by that.

    With ``recency="request"`` (set by the manager on :attr:`recency` before
    first use) the manager also calls :meth:`on_store_miss` and
    :meth:`on_request_finished`, whose defaults fall back on ``touch``, and
    :meth:`clear` on ``reset_cache``.
    """

    recency: Recency = "touch"
    """The manager's recency mode (a policy may adapt its rules to it)."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> int | None:
        """Block id of ``key``, or None when it is not cached."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def items(self) -> Iterator[tuple[OffloadKey, int]]:
        """Every cached ``(key, block_id)``, first eviction candidate first."""

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """Add new blocks (being written), in the given order."""

    @abstractmethod
    def remove(self, keys: Iterable[OffloadKey]) -> None:
        """Forget cached keys (a failed store); ghost history is untouched."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], writing: Container[OffloadKey]) -> None:
        """Mark ``keys`` used, last to first; ``writing`` holds unready keys."""

    @abstractmethod
    def evict(self, n: int, exclude: Sequence[Container[OffloadKey]]) -> Evicted | None:
        """Remove ``n`` evictable blocks, all or nothing."""

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """A request offered ``keys``, none of them cached, for storing.

        Called once per key per request (``recency="request"``), before the
        keys are inserted and whether or not the store then fits. The
        default touches them: for ARC that is a ghost-list hit (the target
        adapts), for LRU a no-op (absent keys are ignored).
        """
        self.touch(keys, frozenset())

    def on_request_finished(
        self,
        keys: Sequence[OffloadKey],
        insertion_only: Container[OffloadKey],
        reused: Container[OffloadKey],
        writing: Container[OffloadKey],
    ) -> None:
        """One request's use of ``keys`` (prefix order, head first), applied once.

        ``insertion_only`` holds the keys this request stored and never read
        back; ``reused`` those it loaded, or offered while they were ready
        (a key it stored itself is never in ``reused``). Keys in neither
        were offered but not stored (refused or filtered). The default
        touches every key, so the head of the prefix ends most recent.
        """
        self.touch(keys, writing)

    def clear(self) -> None:
        """Forget every cached key and any history (``reset_cache``).

        The default removes every cached key; policies with more state
        (ARC's ghost lists and target) override it.
        """
        self.remove([key for key, _ in self.items()])

    def membership_tables(self) -> tuple[Container[object], Container[object]]:
        """Two containers whose union is exactly the cached keys, kept up to date.

        The manager's ``lookup`` tests ``key in a or key in b`` inline, so
        returning the policy's own dicts saves a Python call per lookup. The
        default is ``(self, <empty>)``, which is always correct.
        """
        return self, frozenset()

    def block_ids(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Block ids of ``keys``, in order; raises ``KeyError`` for an absent key."""
        ids: list[int] = []
        for key in keys:
            block_id = self.get(key)
            if block_id is None:
                raise KeyError(key)
            ids.append(block_id)
        return ids

    def uncached(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The ``keys`` (distinct) that are not cached, in order: what a store adds."""
        return [key for key in keys if key not in self]

    def prefix_len(self, keys: Iterable[OffloadKey]) -> int:
        """How many leading ``keys`` are cached (ready or not)."""
        return sum(1 for _ in takewhile(self.__contains__, keys))
