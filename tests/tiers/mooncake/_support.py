"""Shared pieces of the Mooncake tier tests: Offloaders over one cluster, and waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from aiokvo import Offloader
from aiokvo.testing.mooncake_fake import FakeMooncakeCluster
from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.mooncake import MooncakeTier
from aiokvo.tiers.mooncake.store import MooncakeTierStatistics
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


def fake_tier(cluster: FakeMooncakeCluster, **settings: Any) -> StoreTier:
    options: dict[str, Any] = {"model_id": "test-model", "local_hostname": "127.0.0.1", **FAST}
    options.update(settings)
    return MooncakeTier("127.0.0.1:1", store_factory=cluster.store, **options)


def replica(tier: StoreTier, kv: KV | None = None, cpu_blocks: int = CPU_BLOCKS) -> Offloader:
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


class PagesKV:
    """Like :class:`~tests.offloader._harness.KV`, with pages of any size: ``layers``
    tensors of ``(num_blocks, page)`` int8 whose rows are a function of the key."""

    def __init__(self, num_blocks: int = 64, *, page: int = 64 << 10, layers: int = 2) -> None:
        import torch

        from aiokvo import CanonicalKVCaches

        self.page_bytes = page
        self.layers = [torch.zeros(num_blocks, page, dtype=torch.int8) for _ in range(layers)]
        self.caches = CanonicalKVCaches.from_engine([self.layers])

    def page(self, key: bytes, layer: int) -> Any:
        import numpy as np

        seed = int.from_bytes(key[:8], "little") ^ layer
        return np.random.default_rng(seed).integers(-128, 128, self.page_bytes, dtype=np.int8)

    def write(self, blocks: list[int], ks: list[bytes]) -> None:
        for block, k in zip(blocks, ks, strict=True):
            for layer, tensor in enumerate(self.layers):
                tensor[block].numpy()[:] = self.page(k, layer)

    def holds(self, blocks: list[int], ks: list[bytes]) -> bool:
        import numpy as np

        return all(
            np.array_equal(tensor[block].numpy(), self.page(k, layer))
            for block, k in zip(blocks, ks, strict=True)
            for layer, tensor in enumerate(self.layers)
        )

    def config(self, cpu_blocks: int) -> Any:
        from aiokvo import OffloadConfig

        return OffloadConfig(
            gpu_block_sizes=(16,),
            hash_block_size=16,
            kv_bytes_per_block=self.caches.page_bytes_per_block,
            cpu_bytes_to_use=cpu_blocks * self.caches.page_bytes_per_block,
        )
