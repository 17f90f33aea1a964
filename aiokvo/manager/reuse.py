"""Store only blocks that are asked for again (seed chapter 3; vLLM 0.32's variant).

A block used by one request only is not worth a CPU copy: it costs pool
space and DMA bandwidth and is unlikely to be read back. This wrapper
counts how often each key is seen and lets ``prepare_store`` through only
for keys seen at least ``store_threshold`` times. The counter is bounded;
when full, the key seen least recently is forgotten.

What is counted is the ``counting`` mode:

``"lookups"`` (the seed's, the default)
    every ``lookup`` of a key, and the keys ``lookup_prefix`` would look up;
    every key of a store is filtered.
``"offers"`` (vLLM 0.32's)
    every offer of a key to ``prepare_store``, counted at the top of the
    call; only keys that are not held yet are filtered (ready or in-flight
    ones pass), and the ones filtered out are counted in
    ``statistics().reuse_filtered_blocks`` (vLLM's skipped stores). A full tracker
    never forgets a key of the current offer to make room. Counting lookups
    never warms a prefix that is only ever stored: a request that misses
    makes one offer per key, so with lookups counted a cold prefix would
    need ``store_threshold`` lookups of keys nobody stores (vLLM PR #52227).

It answers the same questions as the manager it wraps (``num_blocks``,
``num_free_blocks``, ``block_status``, ``len()``, ``store_refusal``) by
asking it, so code written against a ``CPUOffloadingManager`` keeps working
when ``store_threshold`` turns the filter on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sized
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, TypeAlias, cast

from aiokvo._util import check_choice, check_int
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey, check_keys, key_sequence
from aiokvo.manager.base import OffloadingManager, StoreRefusal
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies.base import BlockStatus
from aiokvo.manager.requests import KeyPosition
from aiokvo.manager.sink import OverflowPolicy
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.specs import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput, ReqContext

if TYPE_CHECKING:
    from aiokvo.events import EventSubscription

__all__ = ["COUNTING_MODES", "Counting", "FilterReusedOffloadingManager"]

_PROBE = ReqContext()  # presence checks of managers other than the CPU one

Counting: TypeAlias = Literal["lookups", "offers"]
"""What the reuse filter counts: lookups (the seed) or store offers (vLLM 0.32)."""

COUNTING_MODES: tuple[Counting, ...] = ("lookups", "offers")


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps ``backing`` and filters what it is asked to store by reuse count."""

    def __init__(
        self,
        backing: OffloadingManager,
        store_threshold: int = 2,
        max_tracker_size: int = 64_000,
        *,
        counting: Counting = "lookups",
    ) -> None:
        if not isinstance(backing, OffloadingManager):
            raise ConfigError(f"backing must be an OffloadingManager, got {backing!r}")
        store_threshold = check_int("store_threshold", store_threshold, minimum=2)
        max_tracker_size = check_int("max_tracker_size", max_tracker_size, minimum=1)
        self.counting: Counting = check_choice("counting", counting, COUNTING_MODES)
        self.backing = backing
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._sink = backing._sink
        self._filtered = 0
        self._offers = self.counting == "offers"

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

    def _count_offer(self, keys: list[OffloadKey]) -> None:
        """Count one offer (vLLM 0.32): +1 for every key, never evicting one of them."""
        counts = self.counts
        offered: set[OffloadKey] = set()
        for key in keys:
            seen = counts.get(key)
            if seen is not None:
                counts.move_to_end(key)
                counts[key] = seen + 1
                offered.add(key)
        # Keys counted above now sit at the MRU end, so popping from the LRU
        # end forgets older keys first; once only this offer's keys are left,
        # further new keys are not tracked.
        unprotected = len(counts) - len(offered)
        limit = self.max_tracker_size
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= limit:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def _uncached(self, keys: list[OffloadKey]) -> set[OffloadKey]:
        backing = self.backing
        if isinstance(backing, CPUOffloadingManager):
            return set(backing.policy.uncached(keys))
        return {key for key in keys if backing.lookup(key, _PROBE) is False}

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        found = self.backing.lookup(key, req_context)  # checks the key before it is counted
        if self._offers:
            return found
        self._count((key,))
        return found

    def lookup_prefix(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> int | None:
        """As the lookup loop: counts every key it would look up, stopper included."""
        keys = key_sequence(keys, "lookup_prefix")
        if self._offers:
            return self.backing.lookup_prefix(keys, req_context)
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
        if self._offers:
            keys = list(keys)
            check_keys(keys, "prepare_store")  # counting the offer changes state: check first
            self._count_offer(keys)
            new = self._uncached(keys)
            eligible = [key for key in keys if key not in new or get(key, 0) >= threshold]
            self._filtered += len(keys) - len(eligible)
            return self.backing.prepare_store(eligible, req_context)
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

    def on_request_finished(
        self, req_context: ReqContext, position: KeyPosition | None = None
    ) -> None:
        self.backing.on_request_finished(req_context, position)

    def reset_cache(self, *, announce: bool = True) -> None:
        """Reset the backing manager; the reuse counts are kept (they describe
        demand, not what the pool holds; vLLM 0.32 keeps them too)."""
        self.backing.reset_cache(announce=announce)

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
