"""Shared pieces of the disk-tier tests: engine-shaped KV with checkable bytes, and
``FileIO`` seams that fail, stall or count."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import torch

from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, make_offload_key
from aiokvo.keys import OffloadKey
from aiokvo.tiers import DiskTier, FileIO
from aiokvo.tiers.disk.store import DiskStore
from aiokvo.tiers.engine import StoreTier

BLOCK_TOKENS = 16

STALL_DEADLINE = 1.0
"""``io_timeout`` for a tier whose reads a test stalls on purpose: the test waits it
out once, and a loaded machine's read threads reach the stalled call well before it
(a read not started by its deadline is never started, and nothing would stall).
Fill such a tier's blocks in under the default deadline, from another tier on the
same root: a short one lets a busy disk time a write out."""


def key(name: str, group: int = 0) -> OffloadKey:
    return make_offload_key(hashlib.blake2b(name.encode(), digest_size=16).digest(), group)


def keys(prefix: str, n: int, group: int = 0) -> list[OffloadKey]:
    return [key(f"{prefix}{i}", group) for i in range(n)]


class KV:
    """``layers`` tensors of ``(num_blocks, page)`` int8 GPU blocks; the bytes of a block
    are a function of its key (and ``salt``: two writers of one key with different
    salts write different bytes, so a mix of the two is visible), so every reload is
    checked byte for byte."""

    def __init__(
        self, num_blocks: int = 64, *, page: int = 4096, layers: int = 2, salt: bytes = b""
    ) -> None:
        self.page_bytes = page
        self.salt = salt
        self.layers = [torch.zeros(num_blocks, page, dtype=torch.int8) for _ in range(layers)]
        self.caches = CanonicalKVCaches.from_engine(self.layers)

    def page(self, k: OffloadKey, layer: int, salt: bytes | None = None) -> np.ndarray:
        salt = self.salt if salt is None else salt
        digest = hashlib.shake_128(salt + bytes(k) + bytes([layer])).digest(self.page_bytes)
        return np.frombuffer(digest, dtype=np.int8)

    def version(self, block: int, k: OffloadKey, salts: Sequence[bytes]) -> bytes | None:
        """Which of ``salts`` wrote every layer of GPU block ``block`` for ``k`` (None: none
        did, whole: a torn or corrupted block)."""
        for salt in salts:
            if all(
                np.array_equal(tensor[block].numpy(), self.page(k, layer, salt))
                for layer, tensor in enumerate(self.layers)
            ):
                return salt
        return None

    def write(self, blocks: Sequence[int], ks: Sequence[OffloadKey]) -> None:
        for block, k in zip(blocks, ks, strict=True):
            for layer, tensor in enumerate(self.layers):
                tensor[block].numpy()[:] = self.page(k, layer)

    def holds(self, blocks: Sequence[int], ks: Sequence[OffloadKey]) -> bool:
        return all(
            np.array_equal(tensor[block].numpy(), self.page(k, layer))
            for block, k in zip(blocks, ks, strict=True)
            for layer, tensor in enumerate(self.layers)
        )

    def clear(self, blocks: Sequence[int]) -> None:
        for tensor in self.layers:
            tensor[list(blocks)] = 0

    def config(self, cpu_blocks: int, **options: Any) -> OffloadConfig:
        return OffloadConfig(
            gpu_block_sizes=(BLOCK_TOKENS,),
            hash_block_size=BLOCK_TOKENS,
            kv_bytes_per_block=self.caches.page_bytes_per_block,
            cpu_bytes_to_use=cpu_blocks * self.caches.page_bytes_per_block,
            **options,
        )

    def slot_bytes(self) -> int:
        return -(-self.caches.page_bytes_per_block // 4096) * 4096


def disk_tier(root: Path, *, slots: int = 64, kv: KV | None = None, **options: Any) -> StoreTier:
    """A tier of exactly ``slots`` slots for ``kv``'s blocks (one block: slot_bytes)."""
    slot = (kv or KV()).slot_bytes()
    capacity = options.pop("capacity_bytes", None)
    if capacity is None:
        index = 4096 + -(-slots * 128 // 4096) * 4096
        capacity = index + slots * slot
    options.setdefault("model_id", "test-model")
    options.setdefault("refresh_interval", 0)
    return DiskTier(root, capacity_bytes=capacity, **options)


def offloader(kv: KV, root: Path, *, cpu_blocks: int = 8, **tier_options: Any) -> Offloader:
    config_options = tier_options.pop("config_options", {})
    return Offloader(
        kv.config(cpu_blocks, **config_options), kv.caches,
        tiers=[disk_tier(root, kv=kv, **tier_options)],
    )  # fmt: skip


async def fill(off: Offloader, kv: KV, ks: Sequence[OffloadKey], start: int = 0) -> None:
    """Store ``ks`` from GPU blocks ``start...`` (written with their bytes), in CPU-sized bites."""
    blocks = list(range(start, start + len(ks)))
    kv.write(blocks, ks)
    result = await off.store(list(ks), blocks)
    assert result.ok, result
    await off.drain()


def is_disk_tier(tier: object) -> TypeGuard[StoreTier]:
    """``tier`` is a disk tier (``DiskTier(...)`` makes a StoreTier over a DiskStore)."""
    return isinstance(tier, StoreTier) and isinstance(tier.store, DiskStore)


def data_file(tier: StoreTier, slab: int = 0) -> Path:
    return tier.store.directory / f"slab-{slab:04d}.data"


class FaultyIO(FileIO):
    """Fails or stalls reads/writes on demand; counts calls. Thread-safe enough for tests."""

    def __init__(self) -> None:
        self.fail_writes: int | None = None  # errno for every pwritev, while set
        self.fail_reads: int | None = None
        self.fail_after_bytes: int | None = None  # ENOSPC once this many payload bytes written
        self.read_gate = threading.Event()
        self.read_gate.set()
        self.write_gate = threading.Event()
        self.write_gate.set()
        self.written = 0
        self.syncs = 0
        self.reads = 0
        self.stalled_reads = 0  # preadv calls that found the read gate closed
        self.writes = 0
        self.reader_threads: set[str] = set()  # names of the threads that called preadv
        # While set, each thread's first preadv waits here for the others: a read shared
        # by n threads needs n at once, however the pool hands its shares out.
        self.rendezvous: threading.Barrier | None = None
        # Reads touching these byte ranges of a data file wait for hold_gate (held is set
        # once one does): one request's stalled read, the others' untouched.
        self.hold: list[tuple[int, int]] = []
        self.hold_gate = threading.Event()
        self.held = threading.Event()
        self.held_by = ""  # the name of the thread whose read waited there

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if not self.write_gate.wait(60):
            raise TimeoutError("the test never opened the write gate")
        self.writes += 1
        if self.fail_writes is not None:
            raise OSError(self.fail_writes, os.strerror(self.fail_writes))
        size = sum(memoryview(b).nbytes for b in buffers)
        if self.fail_after_bytes is not None and self.written + size > self.fail_after_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += size
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        name = threading.current_thread().name
        first = name not in self.reader_threads
        self.reader_threads.add(name)  # before the gates
        end = offset + sum(memoryview(b).nbytes for b in buffers)
        if any(lo < end and offset < hi for lo, hi in self.hold):
            self.held_by = name
            self.held.set()
            if not self.hold_gate.wait(60):
                raise TimeoutError("the test never opened the hold gate")
        if not self.read_gate.is_set():
            self.stalled_reads += 1
        if not self.read_gate.wait(60):
            raise TimeoutError("the test never opened the read gate")
        self.reads += 1
        rendezvous = self.rendezvous
        if first and rendezvous is not None:
            rendezvous.wait()
        if self.fail_reads is not None:
            raise OSError(self.fail_reads, os.strerror(self.fail_reads))
        return super().preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        self.syncs += 1
        super().fdatasync(fd)
