"""Where a manager's events go: a recording list and any number of subscribers.

Kept free of asyncio (and of :mod:`aiokvo.events`) so the core stays
importable and testable without a loop: a subscriber is anything with
``push`` and ``close`` that can be weakly referenced, and registers itself here.

Subscribers are held *weakly*. A subscription that its reader dropped without
closing (``async for e in sub: return``) used to stay attached for good, and
every event was pushed into every such buffer: 300 of them made manager
operations 20 times slower. Now it detaches when it is collected, which in
CPython is the moment the last reference goes. Whoever subscribes keeps the
subscription alive (a reader waiting on it does); nothing else has to.
"""

from __future__ import annotations

import weakref
from typing import Literal, Protocol

from aiokvo.errors import ConfigError
from aiokvo.specs import OffloadingEvent

__all__ = ["EventSink", "OverflowPolicy", "Subscriber"]

OverflowPolicy = Literal["drop_oldest", "drop_newest"]
"""Which event a full subscription drops: its oldest buffered one, or the new one."""


class Subscriber(Protocol):
    """What the sink needs of a subscription (``aiokvo.events.EventSubscription``).

    The sink holds it weakly, so it must be weakly referenceable (a class
    with ``__slots__`` lists ``"__weakref__"``) and kept alive by its owner.
    """

    def push(self, event: OffloadingEvent) -> None: ...

    def close(self) -> None: ...


class EventSink:
    """Fan-out point for events; the only event plumbing a manager owns."""

    __slots__ = ("__weakref__", "_recorded", "_subscribers")

    def __init__(self, record: bool) -> None:
        self._recorded: list[OffloadingEvent] | None = [] if record else None
        # Replaced, never mutated, so a publish in progress keeps its snapshot.
        self._subscribers: list[weakref.ref[Subscriber]] = []

    @property
    def active(self) -> bool:
        """True when anybody would see an event (cheap hot-path guard)."""
        return self._recorded is not None or bool(self._subscribers)

    def __len__(self) -> int:
        """Subscribers attached now."""
        return len(self._subscribers)

    def publish(self, event: OffloadingEvent) -> None:
        if self._recorded is not None:
            self._recorded.append(event)
        for ref in self._subscribers:
            subscriber = ref()
            if subscriber is not None:
                subscriber.push(event)

    def take(self) -> list[OffloadingEvent]:
        if not self._recorded:
            return []
        events, self._recorded = self._recorded, []
        return events

    def attach(self, subscription: Subscriber) -> None:
        """Deliver events to ``subscription`` until it is closed or collected."""
        sink = weakref.ref(self)

        def collected(ref: weakref.ref[Subscriber]) -> None:
            owner = sink()
            if owner is not None:
                owner._subscribers = [r for r in owner._subscribers if r is not ref]

        try:
            ref = weakref.ref(subscription, collected)
        except TypeError:
            raise ConfigError(
                f"a subscriber must be weakly referenceable (the sink holds it weakly), "
                f"got {subscription!r}"
            ) from None
        self._subscribers = [*self._subscribers, ref]

    def detach(self, subscription: Subscriber) -> None:
        self._subscribers = [r for r in self._subscribers if r() is not subscription]

    def close_all(self) -> None:
        subscriptions = [ref() for ref in self._subscribers]
        self._subscribers = []
        for subscription in subscriptions:
            if subscription is not None:
                subscription.close()
