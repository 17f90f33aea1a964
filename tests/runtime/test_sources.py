"""HostEvent: the completion source host worker threads set."""

from __future__ import annotations

import threading

import pytest

from aiokvo.runtime.poller import NotifyingSource
from aiokvo.runtime.sources import CompletionSource, HostEvent


def test_host_event_is_a_notifying_completion_source() -> None:
    event = HostEvent()
    assert isinstance(event, CompletionSource)
    assert isinstance(event, NotifyingSource)


def test_query_is_false_until_set_then_true() -> None:
    event = HostEvent()
    assert event.query() is False
    event.set()
    assert event.query() is True
    event.synchronize()  # returns at once


def test_failure_is_raised_by_query_and_synchronize() -> None:
    event = HostEvent()
    event.set_exception(RuntimeError("copy failed"))
    with pytest.raises(RuntimeError, match="copy failed"):
        event.query()
    with pytest.raises(RuntimeError, match="copy failed"):
        event.synchronize()


def test_wake_registered_before_completion_fires_once_on_set() -> None:
    event = HostEvent()
    calls: list[str] = []
    event.notify_when_done(lambda: calls.append("a"))
    event.notify_when_done(lambda: calls.append("b"))
    assert calls == []
    event.set()
    assert calls == ["a", "b"]
    event.set()  # a second set must not wake again
    assert calls == ["a", "b"]


def test_wake_registered_after_completion_fires_immediately() -> None:
    event = HostEvent()
    event.set_exception(ValueError("x"))
    calls: list[int] = []
    event.notify_when_done(lambda: calls.append(1))
    assert calls == [1]


def test_synchronize_blocks_until_another_thread_sets() -> None:
    event = HostEvent()
    woke = threading.Event()
    event.notify_when_done(woke.set)
    setter = threading.Timer(0.05, event.set)
    setter.start()
    event.synchronize()
    setter.join()
    assert event.query() and woke.is_set()
