"""``SlotManager``: the CPU manager's pool and policies over a tier's own slots.

A disk tier has the same bookkeeping problem as the CPU pool: a fixed
number of equal slots, keys being written (not readable yet), keys being
read (not evictable), and a policy choosing what to evict. So it reuses
:class:`~aiokvo.manager.cpu.CPUOffloadingManager` whole (its exact
decisions, LRU and ARC, and its statistics) and adds the two things a tier
needs that the CPU pool never does:

* :meth:`~aiokvo.manager.cpu.CPUOffloadingManager.remove` (every CPU
  manager has it): drop idle keys by name (a block that failed its
  checksum, or whose file went away), publishing a removal;
* :meth:`SlotManager.adopt`: rebuild the pool from what a previous process
  left on disk, each key in the slot it was found in.

Its events carry the tier's ``medium`` (``"DISK"``), and may go to a sink it
shares with the CPU manager, so one subscription sees every tier in order.
Pure and synchronous, like the manager it extends.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiokvo._util import check_int
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies.base import CachePolicy
from aiokvo.manager.sink import EventSink
from aiokvo.specs import OffloadingEvent

__all__ = ["SlotManager"]


class SlotManager(CPUOffloadingManager):
    """``num_slots`` slots of one tier, allocated and evicted as the CPU pool is.

    ``medium`` names the tier in its events; ``sink``, if given, is where
    they go (typically the CPU manager's, see :attr:`OffloadingManager.sink
    <aiokvo.manager.base.OffloadingManager.sink>`).
    """

    def __init__(
        self,
        num_slots: int,
        cache_policy: str | type[CachePolicy] = "lru",
        *,
        medium: str,
        sink: EventSink | None = None,
    ) -> None:
        super().__init__(check_int("num_slots", num_slots, minimum=1), cache_policy)
        if not isinstance(medium, str) or not medium:
            raise ConfigError(f"medium must be a non-empty string, got {medium!r}")
        self.medium = medium
        if sink is not None:
            self._sink = sink

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot ``key`` holds (ready or being written), or None."""
        return self._policy.get(key)

    def is_ready(self, key: OffloadKey) -> bool:
        """``key`` is held and not being written (no counter moves, unlike ``lookup``)."""
        return key in self._policy and key not in self._writing

    def adopt(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Start from ``keys`` found ready in ``slots`` (oldest first); the rest are free.

        Only on an empty manager (before any other call). Every slot must be in
        range and used once, every key once; the last key ends up most recent.
        Publishes one "stored" event for the adopted keys.
        """
        if len(self._policy) or self._num_allocated or self._free_ids:
            raise ConfigError("adopt() needs a fresh SlotManager")
        if len(keys) != len(slots):
            raise ConfigError(f"adopt() got {len(keys)} keys but {len(slots)} slots")
        used = set()
        for slot in slots:
            slot = check_int("slot", slot, minimum=0, maximum=self._num_blocks - 1)
            if slot in used:
                raise ConfigError(f"adopt() got slot {slot} twice")
            used.add(slot)
        if len(set(keys)) != len(keys):
            raise ConfigError("adopt() got a key twice")
        # Every slot counts as handed out; the free ones go on the free list so
        # that the lowest is handed out first (the list is used from its end).
        self._num_allocated = self._num_blocks
        self._free_ids = [s for s in range(self._num_blocks - 1, -1, -1) if s not in used]
        if keys:
            self._policy.insert(list(keys), [int(s) for s in slots])
            if self._sink.active:
                self._sink.publish(OffloadingEvent(list(keys), self.medium, False))
