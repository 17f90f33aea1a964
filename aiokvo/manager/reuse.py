"""Store only blocks that are looked up again (seed chapter 3).

A block used by one request only is not worth a CPU copy: it costs pool
space and DMA bandwidth and is unlikely to be read back. This wrapper
counts how often each key is looked up and lets ``prepare_store`` through
only for keys seen at least ``store_threshold`` times. The counter is
bounded; when full, the key looked up least recently is forgotten.

It answers the same questions as the manager it wraps (``num_blocks``,
``num_free_blocks``, ``block_status``, ``len()``, ``store_refusal``) by
asking it, so code written against a ``CPUOffloadingManager`` keeps working
when ``store_threshold`` turns the filter on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sized
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from aiokvo._util import check_int
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey, check_keys, key_sequence
from aiokvo.manager.base import OffloadingManager, StoreRefusal
from aiokvo.manager.policies.base import BlockStatus
from aiokvo.manager.sink import OverflowPolicy
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.specs import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput, ReqContext

if TYPE_CHECKING:
    from aiokvo.events import EventSubscription

__all__ = ["FilterReusedOffloadingManager"]


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps ``backing`` and filters what it is asked to store by reuse count."""

    def __init__(
        self,
        backing: OffloadingManager,
        store_threshold: int = 2,
        max_tracker_size: int = 64_000,
    ) -> None:
        if not isinstance(backing, OffloadingManager):
            raise ConfigError(f"backing must be an OffloadingManager, got {backing!r}")
        store_threshold = check_int("store_threshold", store_threshold, minimum=2)
        max_tracker_size = check_int("max_tracker_size", max_tracker_size, minimum=1)
        self.backing = backing
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._sink = backing._sink
        self._filtered = 0

    # -- what the backing manager answers -----------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.backing.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.backing.num_free_blocks

    def block_status(self, key: OffloadKey) -> BlockStatus | None:
        return self.backing.block_status(key)

    @property
    def store_refusal(self) -> StoreRefusal | None:
        return self.backing.store_refusal

    def __len__(self) -> int:
        return len(cast(Sized, self.backing))

    # -- the filter ------------------------------------------------------------------

    def _count(self, keys: Iterable[OffloadKey]) -> None:
        counts = self.counts
        limit = self.max_tracker_size
        for key in keys:
            seen = counts.get(key)
            if seen is not None:
                counts.move_to_end(key)
                counts[key] = seen + 1
            else:
                if len(counts) >= limit:
                    counts.popitem(last=False)
                counts[key] = 1

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        found = self.backing.lookup(key, req_context)  # checks the key before it is counted
        self._count((key,))
        return found

    def lookup_prefix(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> int | None:
        """As the lookup loop: counts every key it would look up, stopper included."""
        keys = key_sequence(keys, "lookup_prefix")
        hits = self.backing.lookup_prefix(keys, req_context)
        if hits is None:
            # The loop stopped at the first key that is not ready (and is
            # in flight): find it without counting anything twice.
            hits = 0
            for key in keys:
                if self.backing.lookup(key, req_context) is not True:
                    break
                hits += 1
            self._count(keys[: hits + 1])
            return None
        self._count(keys[: hits + 1])
        return hits

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = key_sequence(keys, "prepare_store")
        threshold = self.store_threshold
        get = self.counts.get
        try:
            eligible = [key for key in keys if get(key, 0) >= threshold]
        except TypeError:  # unhashable
            eligible = []
        if len(eligible) != len(keys):  # counted keys were checked by their lookup
            check_keys(keys, "prepare_store")
        self._filtered += len(keys) - len(eligible)
        return self.backing.prepare_store(eligible, req_context)

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> LoadStoreSpec:
        return self.backing.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        self.backing.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        self.backing.complete_load(keys)

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        self.backing.complete_store(keys, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.backing.take_events()

    def subscribe(
        self, *, maxsize: int = 1024, overflow: OverflowPolicy = "drop_oldest"
    ) -> EventSubscription:
        return self.backing.subscribe(maxsize=maxsize, overflow=overflow)

    def statistics(self) -> ManagerStatistics:
        """The backing manager's snapshot plus this filter's two counters.

        Lookups are counted by the backing manager as it is asked; when the
        prefix stops at a store in flight, the filter asks it key by key to
        find where, and those lookups count too.
        """
        return replace(
            self.backing.statistics(),
            reuse_tracked_keys=len(self.counts),
            reuse_filtered_blocks=self._filtered,
        )

    def shutdown(self) -> None:
        self.backing.shutdown()
