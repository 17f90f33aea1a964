"""Test helpers: wait for in-flight work, then check that nothing was left behind.

Everything is read through public APIs (a manager's ``block_status``,
``num_free_blocks`` and ``len()``; a handler's ``in_flight``; the fake
driver's live-object counts; thread names), so the checks hold for any
manager or backend that keeps aiokvo's contract, not just the built-in ones.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Iterable
from typing import Any, Protocol, cast

from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey, describe_key
from aiokvo.manager.policies.base import WRITING, BlockStatus
from aiokvo.specs import TransferResult

__all__ = ["assert_no_leaks", "drain", "leaked_threads", "offloader_leaks"]

THREAD_PREFIX = "aiokvo-"
POLLER_THREAD_PREFIX = "aiokvo-waiter-"
"""The event poller's waiter threads: the loop's, not any handler's (they end
when the loop closes or after the poller's ``idle_thread_timeout``)."""


class _Manager(Protocol):
    def block_status(self, key: OffloadKey) -> BlockStatus | None: ...

    def __len__(self) -> int: ...


class _Offloader(Protocol):
    def statistics(self) -> Any: ...


class _InFlight(Protocol):
    @property
    def in_flight(self) -> int: ...


async def drain(*work: object, timeout: float = 30.0) -> list[TransferResult]:
    """Wait until ``work`` is done: each transfer task resolved, each handler idle.

    ``work`` holds transfer tasks (anything awaitable that resolves to a
    ``TransferResult``) and handlers (anything with ``in_flight``). Returns
    the tasks' results in the order given; a task never raises for a failed
    copy, its result says so. Raises ``AssertionError`` after ``timeout``
    seconds, naming what is still in flight.
    """
    tasks: list[Awaitable[TransferResult]] = []
    handlers: list[_InFlight] = []
    for item in work:
        if hasattr(item, "in_flight"):
            handlers.append(cast(_InFlight, item))
        elif inspect.isawaitable(item):
            tasks.append(cast(Awaitable[TransferResult], item))
        else:
            raise ConfigError(f"drain takes transfer tasks and handlers, got {item!r}")
    deadline = time.monotonic() + timeout
    futures = [asyncio.ensure_future(t) for t in tasks]
    if futures:
        _, pending = await asyncio.wait(futures, timeout=timeout)  # cancels nothing
        if pending:
            stuck = [t for t, f in zip(tasks, futures, strict=True) if f in pending]
            raise AssertionError(
                f"{len(stuck)} transfers still in flight after {timeout:g} s: {stuck!r}"
            )
    while busy := [h for h in handlers if h.in_flight]:
        if time.monotonic() >= deadline:
            raise AssertionError(f"handlers still busy after {timeout:g} s: {busy!r}")
        await asyncio.sleep(0.001)
    return [f.result() for f in futures]


def leaked_threads(
    prefix: str = THREAD_PREFIX, *, wait: float = 1.0, ignore: Iterable[threading.Thread] = (),
    ignore_prefixes: tuple[str, ...] = (POLLER_THREAD_PREFIX,),
) -> list[threading.Thread]:
    """Live threads named ``prefix*`` (waiting up to ``wait`` s for them to end).

    Threads in ``ignore`` and those named ``ignore_prefixes*`` (by default the
    event poller's waiters, which belong to the loop) are not counted.
    """
    ignored = set(ignore)
    deadline = time.monotonic() + wait
    while True:
        alive = [t for t in threading.enumerate()
                 if t.name.startswith(prefix) and not t.name.startswith(ignore_prefixes)
                 and t.is_alive() and t not in ignored]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return alive
        alive[0].join(min(left, 0.05))


def _driver_leaks(driver: Any, *, wait: float) -> list[str]:
    """What a fake driver still holds, waiting up to ``wait`` s for waiter threads
    the loop outran to hand their handles back (see :func:`assert_no_leaks`)."""
    driver.current_stream()  # make sure it exists, so that it can be left out
    deadline = time.monotonic() + wait
    while True:
        problems: list[str] = []
        counts = {"streams": driver.live_streams - 1, "events": driver.live_events,
                  "host allocations": driver.live_host_allocations}
        for what, count in counts.items():
            if count:
                problems.append(f"fake driver: {count} {what} still alive")
        if driver.registered:
            problems.append(f"fake driver: host memory still registered: {driver.registered!r}")
        if not problems or time.monotonic() >= deadline:
            return problems
        time.sleep(0.005)


def offloader_leaks(offloader: _Offloader) -> list[str]:
    """What an :class:`~aiokvo.Offloader` still holds that finished work should have let go.

    Read from its ``statistics()``: leases still pinning blocks, copies
    still in flight, keys still being written, coroutines still waiting,
    and a pool whose blocks do not add up (pinned, reserved, or neither
    cached nor free). Empty when it is clean. Call it after ``drain()``.
    """
    stats = offloader.statistics()
    pool = stats.manager
    problems: list[str] = []
    if stats.active_leases:
        problems.append(f"{stats.active_leases} leases from pin_prefix never released")
    if stats.loads_in_flight or stats.stores_in_flight:
        problems.append(f"copies still in flight: {stats.loads_in_flight} loads, "
                        f"{stats.stores_in_flight} stores")
    if stats.writing_keys:
        problems.append(f"{stats.writing_keys} keys still marked as being written")
    if stats.waiters:
        problems.append(f"{stats.waiters} coroutines still waiting in ready() or load_prefix()")
    if pool.pinned_blocks:
        problems.append(f"{pool.pinned_blocks} pool blocks still pinned by loads")
    if pool.writing_blocks:
        problems.append(f"{pool.writing_blocks} pool blocks still reserved by stores "
                        "that never completed")
    if pool.used_blocks + pool.free_blocks != pool.num_blocks:
        problems.append(f"blocks leaked: {pool.used_blocks} used + {pool.free_blocks} free != "
                        f"{pool.num_blocks} blocks")
    return problems


def assert_no_leaks(
    manager: _Manager | None = None,
    keys: Iterable[OffloadKey] = (),
    *,
    offloader: _Offloader | None = None,
    num_blocks: int | None = None,
    driver: Any = None,
    threads: bool = True,
    thread_wait: float = 1.0,
    ignore_threads: Iterable[threading.Thread] = (),
) -> None:
    """Fail (``AssertionError``) if anything outlived the work that used it.

    * ``manager`` and ``keys``: no key is pinned by a load (``ref_cnt > 0``)
      or reserved by a store that never completed (``ref_cnt == -1``);
      with ``num_blocks``, every block is either cached or free
      (``len(manager) + manager.num_free_blocks == num_blocks``).
    * ``offloader`` (an :class:`~aiokvo.Offloader`): everything
      :func:`offloader_leaks` lists (leases never released, copies or
      stores still in flight, pinned or reserved pool blocks, lost blocks).
    * ``driver`` (a :class:`~aiokvo.device.fake.FakeDriver`): no stream,
      event, pinned registration or host allocation is still alive (the
      framework's current stream, ``driver.current_stream()``, is torch's,
      not aiokvo's, and is not counted). A transfer the loop saw finish
      while a poller's waiter thread was still inside
      ``cudaEventSynchronize`` hands its stream and events back as that
      thread leaves the driver: they get ``thread_wait`` seconds too.
    * ``threads``: no thread named ``aiokvo-*`` is still running (each may
      take ``thread_wait`` seconds to finish after its owner closed), except
      the event poller's waiters (``aiokvo-waiter-*``), which serve the loop.

    Call it after closing what the test opened. Every problem is listed.
    """
    problems: list[str] = []
    if manager is not None:
        pinned: list[str] = []
        writing: list[str] = []
        for key in keys:
            status = manager.block_status(key)
            if status is None:
                continue
            if status.ref_cnt == WRITING:
                writing.append(f"{describe_key(key)} (block {status.block_id})")
            elif status.ref_cnt > 0:
                pins = f"block {status.block_id}, {status.ref_cnt} pins"
                pinned.append(f"{describe_key(key)} ({pins})")
        if pinned:
            problems.append(f"{len(pinned)} keys still pinned by loads: {', '.join(pinned)}")
        if writing:
            problems.append(f"{len(writing)} keys still reserved by stores that never completed: "
                            f"{', '.join(writing)}")
        if num_blocks is not None:
            free = getattr(manager, "num_free_blocks", None)
            if free is None:
                problems.append("num_blocks given, but the manager has no num_free_blocks")
            elif len(manager) + free != num_blocks:
                problems.append(f"blocks leaked: {len(manager)} cached + {free} free != "
                                f"{num_blocks} blocks")
    if offloader is not None:
        problems += offloader_leaks(offloader)
    if driver is not None:
        problems += _driver_leaks(driver, wait=thread_wait)
    if threads:
        alive = leaked_threads(wait=thread_wait, ignore=ignore_threads)
        if alive:
            problems.append("threads still running: " + ", ".join(t.name for t in alive))
    if problems:
        raise AssertionError("aiokvo resources leaked:\n  " + "\n  ".join(problems))
