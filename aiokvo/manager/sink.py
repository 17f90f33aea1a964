"""Where a manager's events go: a recording list and any number of subscribers.

Kept free of asyncio (and of :mod:`aiokvo.events`) so the core stays
importable and testable without a loop: a subscriber is anything with
``push`` and ``close``, and registers itself here.
"""

from __future__ import annotations

from typing import Literal, Protocol

from aiokvo.specs import OffloadingEvent

__all__ = ["EventSink", "OverflowPolicy", "Subscriber"]

OverflowPolicy = Literal["drop_oldest", "drop_newest"]
"""Which event a full subscription drops: its oldest buffered one, or the new one."""


class Subscriber(Protocol):
    """What the sink needs of a subscription (``aiokvo.events.EventSubscription``)."""

    def push(self, event: OffloadingEvent) -> None: ...

    def close(self) -> None: ...


class EventSink:
    """Fan-out point for events; the only event plumbing a manager owns."""

    __slots__ = ("_recorded", "_subscribers")

    def __init__(self, record: bool) -> None:
        self._recorded: list[OffloadingEvent] | None = [] if record else None
        self._subscribers: list[Subscriber] = []

    @property
    def active(self) -> bool:
        """True when anybody would see an event (cheap hot-path guard)."""
        return self._recorded is not None or bool(self._subscribers)

    def publish(self, event: OffloadingEvent) -> None:
        if self._recorded is not None:
            self._recorded.append(event)
        for subscriber in self._subscribers:
            subscriber.push(event)

    def take(self) -> list[OffloadingEvent]:
        if not self._recorded:
            return []
        events, self._recorded = self._recorded, []
        return events

    def attach(self, subscription: Subscriber) -> None:
        self._subscribers.append(subscription)

    def detach(self, subscription: Subscriber) -> None:
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)

    def close_all(self) -> None:
        for subscription in list(self._subscribers):
            subscription.close()
        self._subscribers.clear()
