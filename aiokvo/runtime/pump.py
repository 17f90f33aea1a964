"""Driving aiokvo's async objects from synchronous code: a pumped loop or a loop thread.

An engine whose worker calls are synchronous (vLLM's model runner) has no
event loop on its thread. aiokvo's handlers need one: a transfer is
enqueued from a running loop, and its completion is delivered as a loop
callback. Two ways to give them one:

:class:`PumpedLoop` owns a private loop that runs *only inside each call*, on
the caller's thread. :meth:`~PumpedLoop.call` runs a function in one loop
iteration (``loop.stop(); loop.run_forever()``, which polls the selector
once without blocking), :meth:`~PumpedLoop.run` runs an awaitable to the end.
Everything aiokvo does then happens on the caller's thread, so per-thread
state the caller set up is seen as is: torch's current CUDA stream (which a
transfer waits for) and the current device. Between calls the loop does not
run: completions signalled by copy threads wait for the next call (about one
engine step, since the engine polls every step), and timers fire late.

:class:`LoopThread` runs the loop on a thread of its own and hands each call
over with ``run_coroutine_threadsafe``. The loop makes progress between
calls, but each call costs a thread hop, and per-thread state must be
passed explicitly (the caller's stream, captured at submission). It is the
fallback for a caller whose thread already runs an event loop, where a
second loop cannot run.

:func:`make_loop_driver` picks one. See docs/vllm.md for the measurements.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

from aiokvo._util import check_choice

__all__ = [
    "LoopDriver",
    "LoopDriverMode",
    "LoopThread",
    "PumpedLoop",
    "make_loop_driver",
]

T = TypeVar("T")

LoopDriverMode: TypeAlias = Literal["auto", "pump", "thread"]
_MODES: tuple[LoopDriverMode, ...] = ("auto", "pump", "thread")

LoopFactory: TypeAlias = Callable[[], asyncio.AbstractEventLoop]


class LoopDriver(Protocol):
    """What synchronous code needs of an event loop it does not run itself."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def runs_on_caller_thread(self) -> bool:
        """True when ``call`` runs its function on the calling thread."""
        ...

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` run inside the loop; its result, or its exception raised here."""
        ...

    def run(self, awaitable: Awaitable[T]) -> T:
        """Block until ``awaitable`` (made for this loop) is done; its result."""
        ...

    def poll(self) -> None:
        """Let the loop deliver what finished since the last call."""
        ...

    def close(self) -> None:
        """Stop the loop and release it; idempotent."""
        ...


class _Outcome:
    __slots__ = ("error", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None


class _OwnLoop:
    """What both drivers share: the loop they made (``loop_factory``) and own."""

    def __init__(self, loop_factory: LoopFactory | None) -> None:
        self._loop = (loop_factory or asyncio.new_event_loop)()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed


class PumpedLoop(_OwnLoop):
    """A private event loop that runs only inside :meth:`call`, :meth:`run` and :meth:`poll`.

    Calls may come from any thread, one at a time (a lock serialises them;
    asyncio has no guard of its own against two threads running one loop).
    A call from a thread that already runs an event loop raises
    ``RuntimeError``: use :class:`LoopThread` there.
    """

    def __init__(self, loop_factory: LoopFactory | None = None) -> None:
        super().__init__(loop_factory)
        self._lock = threading.Lock()

    @property
    def runs_on_caller_thread(self) -> bool:
        return True

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("the pumped loop is closed")
        if asyncio._get_running_loop() is not None:
            raise RuntimeError(
                "this thread already runs an event loop, so a private loop cannot be "
                "pumped here; use LoopThread (loop driver 'thread')"
            )

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        outcome = _Outcome()  # cheaper than a Future: nothing waits on another thread

        def invoke() -> None:
            try:
                outcome.value = fn(*args)
            except BaseException as exc:
                outcome.error = exc

        with self._lock:
            self._check()
            self._loop.call_soon(invoke)
            self._iterate()
        if outcome.error is not None:
            raise outcome.error
        return outcome.value  # type: ignore[no-any-return]

    def run(self, awaitable: Awaitable[T]) -> T:
        with self._lock:
            self._check()
            return self._loop.run_until_complete(awaitable)

    def poll(self) -> None:
        with self._lock:
            self._check()
            self._iterate()

    def _iterate(self) -> None:
        # Documented: stop() before run_forever() runs the callbacks already
        # scheduled and those of one selector poll (timeout 0), then returns.
        self._loop.stop()
        self._loop.run_forever()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                # Another loop running on this thread cannot be nested into;
                # then async generators (aiokvo makes none) are left as they are.
                if asyncio._get_running_loop() is None:
                    self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()


class LoopThread(_OwnLoop):
    """An event loop on a daemon thread of its own; calls hop to it and wait."""

    def __init__(
        self, loop_factory: LoopFactory | None = None, *, name: str = "aiokvo-loop"
    ) -> None:
        super().__init__(loop_factory)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    @property
    def runs_on_caller_thread(self) -> bool:
        return False

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        self._loop.run_forever()

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("the loop thread is closed")
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.call from its own thread would deadlock")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        self._check()
        done: Future[T] = Future()

        def invoke() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(invoke)
        return done.result()

    def run(self, awaitable: Awaitable[T]) -> T:
        self._check()

        async def wrapper() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result()

    def poll(self) -> None:
        """Nothing to do: the loop runs by itself."""
        self._check()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        future = asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop)
        future.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def make_loop_driver(
    mode: LoopDriverMode = "auto", *, loop_factory: LoopFactory | None = None
) -> LoopDriver:
    """A :class:`PumpedLoop`, or a :class:`LoopThread` for ``"thread"`` and for
    ``"auto"`` when the calling thread already runs an event loop."""
    mode = check_choice("loop driver", mode, _MODES)
    if mode == "thread" or (mode == "auto" and asyncio._get_running_loop() is not None):
        return LoopThread(loop_factory)
    return PumpedLoop(loop_factory)
