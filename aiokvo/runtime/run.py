"""``aiokvo.run``: run a coroutine on the fastest event loop available."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiokvo.runtime.poller import EventPoller

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory where uvloop is installed, else None (stdlib asyncio)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], *, debug: bool = False) -> T:
    """Run ``main`` to completion on uvloop (or asyncio) and return its result.

    Like :func:`asyncio.run`, plus: the loop's :class:`EventPoller` is closed
    before the loop, so its waiter threads exit once the copies they wait on
    are done (copies in flight are never reported as finished early).
    """
    if not asyncio.iscoroutine(main):
        raise TypeError(f"aiokvo.run expects a coroutine, got {main!r}")
    with asyncio.Runner(debug=debug, loop_factory=loop_factory()) as runner:
        return runner.run(_closing_poller(main))


async def _closing_poller(main: Coroutine[Any, Any, T]) -> T:
    try:
        return await main
    finally:
        poller = EventPoller.existing(asyncio.get_running_loop())
        if poller is not None:
            poller.close()
