"""aiokvo.run: uvloop where installed, asyncio otherwise, poller closed with the loop."""

from __future__ import annotations

import asyncio
import sys

import pytest

from aiokvo.runtime.poller import EventPoller
from aiokvo.runtime.run import loop_factory, run
from aiokvo.runtime.sources import HostEvent


def test_run_returns_the_result_on_uvloop() -> None:
    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(main()).startswith("uvloop")


def test_run_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes `import uvloop` fail
    assert loop_factory() is None

    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(main()).startswith("asyncio")


class _WaitOnlySource:
    """A source the poller can only wait on (no ``notify_when_done``), so it needs a thread."""

    def __init__(self) -> None:
        self._event = HostEvent()

    def set(self) -> None:
        self._event.set()

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


def test_run_closes_the_loop_poller_and_its_threads() -> None:
    async def main() -> EventPoller:
        # An idle waiter exits after idle_thread_timeout: make that longer than
        # any stall of a loaded machine, so the thread is still alive below.
        poller = EventPoller(idle_thread_timeout=3600.0)
        source = _WaitOnlySource()
        future = poller.watch("lane", source, mode="thread")
        asyncio.get_running_loop().call_later(0.001, source.set)
        await future
        assert poller.active_threads == 1
        return poller

    poller = run(main())
    assert poller.closed
    assert poller.active_threads == 0


def test_run_propagates_exceptions_and_still_closes_the_poller() -> None:
    pollers: list[EventPoller] = []

    async def main() -> None:
        pollers.append(EventPoller.current())
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        run(main())
    assert pollers[0].closed


def test_run_passes_debug() -> None:
    async def main() -> bool:
        return asyncio.get_running_loop().get_debug()

    assert run(main(), debug=True) is True
    assert run(main()) is False


def test_run_rejects_a_non_coroutine() -> None:
    async def main() -> None:
        return None

    with pytest.raises(TypeError, match="coroutine"):
        run(main)  # type: ignore[arg-type]
