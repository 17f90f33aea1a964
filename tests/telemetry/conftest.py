"""The telemetry tests' Offloader: 8 CPU blocks, host copies through a controllable copy_fn."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from aiokvo import Offloader
from tests.offloader._harness import KV, Copies


@pytest.fixture
async def offloader() -> AsyncIterator[tuple[Offloader, KV, Copies]]:
    kv, copies = KV(64), Copies()
    async with Offloader(kv.config(8), kv.caches, handler_options={"copy_fn": copies}) as off:
        yield off, kv, copies
        copies.gate.set()
