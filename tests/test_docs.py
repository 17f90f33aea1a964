"""The docs' claims about behaviour that tests can check: each claim next to the code."""

from __future__ import annotations

import re
from pathlib import Path

from aiokvo.keys import make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.runtime.poller import NotifyingSource
from aiokvo.runtime.sources import HostEvent
from aiokvo.specs import ReqContext

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _text(page: str) -> str:
    return re.sub(r"\s+", " ", (DOCS / page).read_text())


def test_async_md_says_what_host_event_does() -> None:
    assert isinstance(HostEvent(), NotifyingSource)
    text = _text("async.md")
    assert "`HostEvent` does not implement it" not in text
    assert "`HostEvent` implements it" in text


def test_events_md_says_the_take_events_record_is_unbounded() -> None:
    text = _text("events.md")
    assert "The record is not bounded" in text
    manager = CPUOffloadingManager(8, enable_events=True)
    for i in range(2000):  # stores and evictions, nobody taking events
        out = manager.prepare_store([make_offload_key(b"k%d" % i, 0)], ReqContext())
        assert out is not None
        manager.complete_store(out.reservation)
    events = list(manager.take_events())
    assert len(events) == 2000 + 1992  # every store and every eviction was kept
