"""The docs' claims about behaviour that tests can check: each claim next to the code."""

from __future__ import annotations

import re
from pathlib import Path

from aiokvo.runtime.poller import NotifyingSource
from aiokvo.runtime.sources import HostEvent

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _text(page: str) -> str:
    return re.sub(r"\s+", " ", (DOCS / page).read_text())


def test_async_md_says_what_host_event_does() -> None:
    assert isinstance(HostEvent(), NotifyingSource)
    text = _text("async.md")
    assert "`HostEvent` does not implement it" not in text
    assert "`HostEvent` implements it" in text
