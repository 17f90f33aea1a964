"""The abstract offloading manager: the cache's control plane.

A manager decides which blocks live in the offload tier. It is pure,
synchronous and deterministic: every method runs to completion on the
caller's thread (the event loop's) and never awaits, so a scheduler can call
it on its hot path. Transfers themselves belong to handlers.

Events are delivered two ways: ``take_events()`` returns the events recorded
since the last call (only when ``enable_events`` is set), and
``subscribe()`` hands out an async stream that is fed at the moment each
event is made, whether or not recording is enabled. Recorded events are
kept until ``take_events()`` is called, without bound (as in vLLM): with
``enable_events=True``, call it regularly or use ``subscribe()``, whose
buffers are bounded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiokvo.errors import CapacityError
from aiokvo.keys import OffloadKey, key_sequence
from aiokvo.manager.policies.base import BlockStatus
from aiokvo.manager.requests import KeyPosition
from aiokvo.manager.sink import EventSink, OverflowPolicy
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.specs import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput, ReqContext

if TYPE_CHECKING:
    from aiokvo.events import EventSubscription

__all__ = ["OffloadingManager", "StoreRefusal"]


@dataclass(frozen=True, slots=True)
class StoreRefusal:
    """Why ``prepare_store`` returned None: ``needed`` new blocks, ``free`` of
    ``num_blocks`` free, and not enough of the rest could be evicted.

    ``never_fits`` tells the two cases apart: a request for more blocks than
    the pool has can never be stored (:meth:`error` is the
    :class:`~aiokvo.errors.CapacityError` to raise for it); otherwise the
    blocks in the way are being read, being written or named by the call,
    and the same request may fit later.
    """

    needed: int
    free: int
    num_blocks: int

    @property
    def never_fits(self) -> bool:
        """True when even an empty pool could not hold the request."""
        return self.needed > self.num_blocks

    def error(self) -> CapacityError:
        """A :class:`CapacityError` that says this."""
        return CapacityError(str(self))

    def __str__(self) -> str:
        if self.never_fits:
            return (
                f"a store of {self.needed} new blocks can never fit a pool of "
                f"{self.num_blocks} blocks"
            )
        return (
            f"a store of {self.needed} new blocks found {self.free} free of "
            f"{self.num_blocks}, and could not evict the other {self.needed - self.free}: "
            f"the blocks in the way are being read, written or named by the call"
        )


class OffloadingManager(ABC):
    """Which blocks are offloaded, which are readable, and what to evict.

    Subclasses must set ``self._sink`` (an :class:`EventSink`) in
    ``__init__`` or override :meth:`subscribe` and :meth:`take_events`.
    """

    _sink: EventSink

    # -- introspection (the built-in managers answer all of these) -------------

    @property
    def num_blocks(self) -> int:
        """Size of the pool, in blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not report num_blocks")

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out without evicting anything."""
        raise NotImplementedError(f"{type(self).__name__} does not report num_free_blocks")

    def block_status(self, key: OffloadKey) -> BlockStatus | None:
        """A snapshot of ``key``'s block, or None when it is not offloaded."""
        raise NotImplementedError(f"{type(self).__name__} does not report block_status")

    @property
    def store_refusal(self) -> StoreRefusal | None:
        """Why the latest :meth:`prepare_store` returned None; None after one
        that returned an output (and for managers that do not say)."""
        return None

    # -- the seed's contract -----------------------------------------------------

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if ``key`` is offloaded and readable, False if absent,
        None if it is still being written (ask again later)."""

    def lookup_prefix(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> int | None:
        """Number of leading keys that are readable.

        Returns None when the first key that is not readable is still being
        written, because the prefix may grow once that store completes.
        """
        hits = 0
        for key in key_sequence(keys, "lookup_prefix"):
            found = self.lookup(key, req_context)
            if found is None:
                return None
            if not found:
                break
            hits += 1
        return hits

    @abstractmethod
    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> LoadStoreSpec:
        """Pin every key for reading and say where its data is.

        Every key must be readable; the caller releases the pins with
        :meth:`complete_load` once the copy is done.
        """

    def touch(self, keys: Collection[OffloadKey]) -> None:
        """Mark ``keys`` as recently used (the first key ends up most recent)."""
        return

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        """Release the pins taken by :meth:`prepare_load`."""
        return

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve space for the keys not yet held, evicting if needed.

        Returns None, changing nothing, when room cannot be made
        (:attr:`store_refusal` says why).
        """

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        """Mark stored keys readable, or release them if the copy failed.

        ``keys`` is a :class:`PrepareStoreOutput`'s ``reservation`` (which
        iterates as its keys) or a list of keys.
        """
        return

    def on_request_finished(
        self, req_context: ReqContext, position: KeyPosition | None = None
    ) -> None:
        """The request of ``req_context`` will make no more ``prepare_*`` calls.

        A manager with per-request recency applies the request's use of its
        keys now, in prefix order (``position`` says where each key sits,
        e.g. vLLM's ``ReqContext.get_offload_key_position``; without it, the
        order first seen); others ignore it. ``complete_*`` calls for the
        request's transfers may still follow.
        """
        return

    def reset_cache(self, *, announce: bool = True) -> None:
        """Drop every block, ready or in motion, and all history.

        Transfers prepared before the reset must be finished (their memory
        may be handed out again at once) and never completed afterwards.
        With ``announce``, the dropped ready keys are published as one
        ``removed=True`` event.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support reset_cache")

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events recorded since the last call (empty unless recording).

        The record is unbounded: with ``enable_events=True`` every event is
        kept until this is called (docs/events.md).
        """
        return self._sink.take()

    def subscribe(
        self, *, maxsize: int = 1024, overflow: OverflowPolicy = "drop_oldest"
    ) -> EventSubscription:
        """A bounded async stream of every event made from now on.

        A slow subscriber never blocks the manager: when its queue is full,
        events are dropped by ``overflow`` and counted in ``.dropped``.
        """
        from aiokvo.events import EventSubscription  # keeps the core asyncio-free

        return EventSubscription(self._sink, maxsize=maxsize, overflow=overflow)

    @property
    def sink(self) -> EventSink:
        """Where this manager's events go. Tiers below the CPU pool publish theirs
        here too (with their own medium), so one subscription sees every tier."""
        return self._sink

    def statistics(self) -> ManagerStatistics:
        """A snapshot of the manager's counters and pool (see :class:`ManagerStatistics`).

        The built-in managers count; a subclass that does not override this
        reports zeros.
        """
        return ManagerStatistics()

    def shutdown(self) -> None:
        """Close every subscription; the manager must not be used afterwards."""
        self._sink.close_all()
