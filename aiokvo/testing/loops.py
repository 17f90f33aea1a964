"""Event-loop factories for pytest-asyncio's ``pytest_asyncio_loop_factories`` hook.

The plugin registers :class:`LoopFactories` only when a project opts in (the
``aiokvo_loop_factories`` ini option or ``--aiokvo-loops``): a hook
implementation that is merely present changes how pytest-asyncio runs every
async test of every project that has aiokvo installed, so it must not be
there by default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import pytest

__all__ = ["LOOP_NAMES", "LoopFactories", "LoopFactory", "loop_factory"]

LoopFactory = Callable[[], asyncio.AbstractEventLoop]

LOOP_NAMES = ("uvloop", "asyncio")
"""The loops the plugin knows: uvloop and the standard library's."""


def loop_factory(name: str) -> LoopFactory | None:
    """The factory called ``name``, or None when it is not installed (uvloop)."""
    if name == "asyncio":
        return asyncio.new_event_loop
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            return None
        factory: LoopFactory = uvloop.new_event_loop
        return factory
    raise ValueError(f"unknown event loop {name!r}; known: {', '.join(LOOP_NAMES)}")


class LoopFactories:
    """The hook implementation: ``names`` for every async test, both loops for a test
    marked with one of ``both_loops_markers`` (``aiokvo_both_loops``).

    A name whose loop is not installed is left out; if that leaves nothing,
    the stdlib loop stands in, so a missing uvloop never skips a test.
    """

    def __init__(
        self, names: Sequence[str], *, both_loops_markers: Sequence[str] = ("aiokvo_both_loops",)
    ) -> None:
        for name in names:
            loop_factory(name)  # raises for an unknown name
        self.names = tuple(dict.fromkeys(names))
        self.both_loops_markers = tuple(both_loops_markers)

    def factories(self, names: Sequence[str]) -> dict[str, LoopFactory]:
        found = {name: f for name in names if (f := loop_factory(name)) is not None}
        return found or {"asyncio": asyncio.new_event_loop}

    def pytest_asyncio_loop_factories(
        self, config: pytest.Config, item: pytest.Item
    ) -> Mapping[str, LoopFactory]:
        if any(item.get_closest_marker(name) for name in self.both_loops_markers):
            return self.factories(LOOP_NAMES)
        return self.factories(self.names)
