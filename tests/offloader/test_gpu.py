"""The Offloader over CUDA KV caches (the CUDA backend), on a real device.

Skipped cleanly without one; ``scripts/gpu_check.sh`` runs it. The same
calls as on the host backend, checked byte for byte on the device: a round
trip, a cancelled load that still lands, and many coroutines sharing a
prefix tree.
"""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
import torch

from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, make_offload_key
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler
from aiokvo.keys import OffloadKey

pytestmark = pytest.mark.gpu

PAGE_SHAPE = (16, 8, 16)  # 2 KiB bf16 pages


def key(name: str) -> OffloadKey:
    return make_offload_key(hashlib.blake2b(name.encode(), digest_size=16).digest(), 0)


def value(k: OffloadKey, layer: int) -> float:
    """A value that differs per key and layer and is exact in bf16."""
    return float(int.from_bytes(hashlib.blake2b(bytes(k) + bytes([layer])).digest()[:1]) - 128)


class DeviceKV:
    def __init__(self, blocks: int, layers: int = 3) -> None:
        self.layers = [
            torch.zeros((blocks, *PAGE_SHAPE), dtype=torch.bfloat16, device="cuda")
            for _ in range(layers)
        ]
        self.caches = CanonicalKVCaches.from_block_tensors([self.layers])

    def write(self, blocks: list[int], ks: list[OffloadKey]) -> None:
        for layer, tensor in enumerate(self.layers):
            for block, k in zip(blocks, ks, strict=True):
                tensor[block].fill_(value(k, layer))
        torch.cuda.synchronize()

    def holds(self, blocks: list[int], ks: list[OffloadKey]) -> bool:
        torch.cuda.synchronize()
        return all(
            bool((tensor[block] == value(k, layer)).all())
            for layer, tensor in enumerate(self.layers)
            for block, k in zip(blocks, ks, strict=True)
        )

    def config(self, cpu_blocks: int) -> OffloadConfig:
        page = self.caches.page_bytes_per_block
        return OffloadConfig(
            gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=page,
            cpu_bytes_to_use=cpu_blocks * page,
        )  # fmt: skip


async def test_round_trip_and_a_cancelled_load_on_the_device() -> None:
    kv = DeviceKV(32)
    async with Offloader(kv.config(8), kv.caches) as off:
        assert isinstance(off.worker.routes[("GPU", "CPU")], CudaOffloadingHandler)
        ks = [key(f"k{i}") for i in range(4)]
        kv.write([0, 1, 2, 3], ks)
        assert (await off.store(ks, [0, 1, 2, 3])).stored == tuple(ks)
        assert await off.load_prefix(ks, [10, 11, 12, 13]) == 4
        assert kv.holds([10, 11, 12, 13], ks)
        load = asyncio.ensure_future(off.load_prefix(ks, [20, 21, 22, 23]))
        await asyncio.sleep(0)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        await off.drain()
        s = off.statistics()
        assert (s.manager.pinned_blocks, s.loads_in_flight) == (0, 0)
        if s.cancelled_waits:  # the copy was in flight when the wait was cancelled
            assert kv.holds([20, 21, 22, 23], ks)


async def test_many_coroutines_share_a_prefix_tree_on_the_device() -> None:
    clients, rounds = 64, 4
    kv = DeviceKV(clients * 8)
    mismatches: list[int] = []
    async with Offloader(kv.config(32), kv.caches) as off:

        async def client(index: int) -> None:
            rng = random.Random(index)
            blocks = list(range(index * 8, (index + 1) * 8))
            for _ in range(rounds):
                root, depth = rng.randrange(4), rng.randint(1, 6)
                ks = [key(f"r{root}/{i}") for i in range(depth)]
                ks.append(key(f"c{index}/{rng.randrange(3)}"))
                mine = blocks[: len(ks)]
                n = await off.load_prefix(ks, mine)
                if not kv.holds(mine[:n], ks[:n]):
                    mismatches.append(index)
                kv.write(mine[n:], ks[n:])
                await off.store(ks, mine)

        async with asyncio.timeout(120), asyncio.TaskGroup() as group:
            for index in range(clients):
                group.create_task(client(index))
        s = off.statistics()
        assert mismatches == []
        assert s.blocks_loaded > 0 and s.blocks_stored > 0
        assert (s.manager.pinned_blocks, s.manager.writing_blocks, s.writing_keys) == (0, 0, 0)
