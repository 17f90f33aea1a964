"""Shared pieces of the Mooncake tier tests: Offloaders over one cluster, and waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from aiokvo import Offloader
from aiokvo.tiers.mooncake import MooncakeTier
from aiokvo.tiers.mooncake.fake import FakeMooncakeCluster
from aiokvo.tiers.mooncake.tier import MooncakeTierStatistics
from tests.offloader._harness import KV

CPU_BLOCKS = 16

FAST: dict[str, Any] = {
    "io_timeout": 5.0,
    "lookup_timeout": 2.0,
    "reset_after": 0.05,
    "max_reset_after": 0.2,
    "failure_threshold": 2,
}
"""Settings that let a breaker trip and recover within a test."""


def fake_tier(cluster: FakeMooncakeCluster, **settings: Any) -> MooncakeTier:
    options: dict[str, Any] = {"model_id": "test-model", "local_hostname": "127.0.0.1", **FAST}
    options.update(settings)
    return MooncakeTier("127.0.0.1:1", store_factory=cluster.store, **options)


def replica(tier: MooncakeTier, kv: KV | None = None, cpu_blocks: int = CPU_BLOCKS) -> Offloader:
    """An engine replica: its own KV caches and CPU pool, this tier below."""
    kv = kv or KV(64)
    return Offloader(kv.config(cpu_blocks), kv.caches, tiers=[tier])


def mooncake_stats(off: Offloader) -> MooncakeTierStatistics:
    (stats,) = off.statistics().tiers
    assert isinstance(stats, MooncakeTierStatistics)
    return stats


async def eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait until ``check()`` holds; fail naming ``what`` after ``timeout`` (a hang guard)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
