"""The suite's hang guard: a watchdog turns a hung test into a failure with
every thread's stack; and the fast lane's guard: a test that starts a
process must carry the ``system`` marker (``make quick`` leaves those out).

Everything a user's suite could want too lives in aiokvo's pytest plugin
(``aiokvo.testing``), which this suite uses like any other: the ``gpu``
markers skip without a device, and ``aiokvo_loop_factories`` in pyproject
runs every async test on uvloop (``both_loops`` tests on the stdlib loop
too). This file only wraps those loop factories so the watchdog can wake a
stuck loop."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import importlib.metadata
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Generator, Mapping
from types import FrameType
from typing import Any

import pytest

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _plugin_autoloads() -> bool:
    """Whether pytest loads aiokvo's plugin by its entry point (aiokvo is installed)."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "aiokvo.testing.plugin"
               for ep in importlib.metadata.entry_points(group="pytest11"))


# From a source tree that is not installed (scripts/gpu_check.sh uses PYTHONPATH),
# the entry point is missing: load the plugin by name instead.
pytest_plugins = [] if _plugin_autoloads() else ["aiokvo.testing.plugin"]


@pytest.hookimpl(wrapper=True)
def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Generator[None, Mapping[str, LoopFactory] | None, Mapping[str, LoopFactory] | None]:
    """The plugin's loops (``aiokvo_loop_factories`` in pyproject), known to the hang guard."""
    factories = yield
    if factories is None:
        return None
    return {name: _tracked(factory) for name, factory in factories.items()}


def _tracked(factory: LoopFactory) -> LoopFactory:
    """``factory``, with its loops known to the hang guard (see below)."""
    if _watchdog is None:
        return factory
    watchdog = _watchdog
    return lambda: watchdog.track(factory())


# -- hang guard -----------------------------------------------------------------
# CI gives the whole suite 90 minutes; a deadlock must cost minutes, not all of
# them. Each test phase (setup, call, teardown) gets $AIOKVO_TEST_TIMEOUT seconds
# (default below; 0 disables). On expiry the watchdog prints every thread's
# stack and interrupts the main thread (a signal, plus a wake-up for the test's
# event loop), so the test fails and the run goes on. If the phase has still
# not ended GRACE seconds later -- the main thread is stuck where no signal
# reaches it -- the process exits. The limit also covers interpreter exit,
# where a leaked non-daemon thread would otherwise block forever.

TEST_TIMEOUT_ENV = "AIOKVO_TEST_TIMEOUT"
DEFAULT_TEST_TIMEOUT = 300.0
GRACE = 30.0


class PhaseTimeout(SystemExit):
    """A test phase outlived the watchdog's limit.

    A ``SystemExit`` so that event loops re-raise it out of a callback instead
    of logging it, and code under test catching ``Exception`` cannot swallow it;
    pytest reports it as that test's failure and carries on.
    """


class _Watchdog:
    """One daemon thread that interrupts, then kills, a phase past its deadline."""

    def __init__(self, limit: float, stderr_fd: int) -> None:
        self.limit = limit
        self._out = stderr_fd  # the terminal's stderr: captured output dies with os._exit
        self._cond = threading.Condition()
        self._what: str | None = None
        self._deadline = 0.0
        self._interrupted = False
        self._loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        self._main = threading.main_thread().ident
        signal.signal(signal.SIGALRM, self._on_alarm)
        threading.Thread(target=self._run, name="test-watchdog", daemon=True).start()

    def track(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """Remember a test's loop, to wake it when its test must be interrupted."""
        with self._cond:
            self._loops.add(loop)
        return loop

    def arm(self, what: str) -> None:
        with self._cond:
            self._what, self._interrupted = what, False
            self._deadline = time.monotonic() + self.limit
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._what = None

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        what = self._what
        if what is not None:  # else the phase ended while the signal was on its way
            raise PhaseTimeout(f"{what} ran past {self.limit:g} s (${TEST_TIMEOUT_ENV})")

    def _say(self, text: str) -> None:
        os.write(self._out, text.encode())

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._what is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._say(f"\n*** {self._what}: timed out; stacks of all threads:\n")
                faulthandler.dump_traceback(file=self._out, all_threads=True)
                if self._interrupted or self._main is None:
                    self._say(f"*** {self._what}: still stuck {GRACE:g} s later; exiting\n")
                    os._exit(3)
                self._interrupted = True
                self._deadline = time.monotonic() + GRACE
                signal.pthread_kill(self._main, signal.SIGALRM)
                for loop in list(self._loops):
                    # uvloop retries an interrupted poll without running Python
                    # code; a callback makes the main thread run the handler.
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(_noop)


def _noop() -> None:
    pass


_watchdog: _Watchdog | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _watchdog
    _guard_process_starts()
    limit = float(os.environ.get(TEST_TIMEOUT_ENV) or DEFAULT_TEST_TIMEOUT)
    if limit > 0 and hasattr(signal, "pthread_kill"):
        _watchdog = _Watchdog(limit, os.dup(sys.__stderr__.fileno() if sys.__stderr__ else 2))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _watchdog is not None:
        _watchdog.arm("interpreter exit")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(f"setup of {item.nodeid}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    global _unmarked
    _unmarked = None if item.get_closest_marker("system") else item.nodeid
    try:
        return (yield from _guarded(item.nodeid))
    finally:
        _unmarked = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(f"teardown of {item.nodeid}"))


def _guarded(what: str) -> Generator[None, None, None]:
    if _watchdog is None:
        return (yield)
    _watchdog.arm(what)
    try:
        return (yield)
    finally:
        _watchdog.disarm()


# -- fast-lane guard ------------------------------------------------------------
# `make quick` runs `pytest -m "not system"`: the tests that start clusters,
# processes or real filesystems carry @pytest.mark.system. So that the lane
# stays what it says, a test without the marker that starts a process (a
# Mooncake cluster, a child interpreter, pytester's subprocess runs) fails
# here, naming the marker, in every lane.

_unmarked: str | None = None  # the node id of the running test, if not marked system


class UnmarkedSystemTest(BaseException):
    """A test without ``@pytest.mark.system`` started a process.

    A ``BaseException``, so that code under test that catches ``OSError`` or
    ``Exception`` around a process start cannot hide it.
    """


# Quick probes that libraries run for themselves (platform.processor() runs
# `uname -p` once a process, ctypes.util.find_library runs `ldconfig -p`): not
# what the marker is about, and whichever test happens to run first would trip.
_INCIDENTAL = frozenset({"uname", "ldconfig"})


def _refuse_unmarked(what: str, argv0: object = None) -> None:
    nodeid = _unmarked
    if nodeid is not None and os.path.basename(str(argv0)) not in _INCIDENTAL:
        raise UnmarkedSystemTest(
            f"{nodeid} starts a process ({what}): mark it @pytest.mark.system "
            "(make quick leaves those out)"
        )


def _guard_process_starts() -> None:
    """Route ``subprocess`` and ``asyncio`` process starts through the check (once)."""
    if getattr(subprocess.Popen, "_aiokvo_guarded", False):
        return
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded_execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any) -> Any:
        argv0 = args.split(maxsplit=1)[0] if isinstance(args, str) else next(iter(args), None)
        _refuse_unmarked(f"subprocess: {args!r:.80}", argv0)
        return execute_child(self, args, *rest)

    subprocess.Popen._execute_child = guarded_execute_child  # type: ignore[attr-defined]
    subprocess.Popen._aiokvo_guarded = True  # type: ignore[attr-defined]
    # uvloop starts processes without subprocess.Popen: guard asyncio's entry points.
    for name in ("create_subprocess_exec", "create_subprocess_shell"):
        start = getattr(asyncio, name)

        async def guarded_start(*args: Any, _start: Any = start, **kwargs: Any) -> Any:
            _refuse_unmarked(f"asyncio: {args!r:.80}", args[0] if args else None)
            return await _start(*args, **kwargs)

        setattr(asyncio, name, guarded_start)
        setattr(asyncio.subprocess, name, guarded_start)
