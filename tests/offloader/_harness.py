"""Shared pieces of the Offloader tests.

* :class:`KV` - "GPU" KV caches (CPU tensors) whose block contents are a
  function of the key written there, so any reload can be checked byte for byte.
* :class:`Copies` - a host ``copy_fn`` that can hold copies back (a gate),
  fail them, or slow them down, and counts what it ran.
* :class:`CountingSpec` - a ``CPUOffloadingSpec`` whose manager records every
  reservation and pin and every ``complete_*`` against them, so a test can
  check each was completed exactly once. Loaded through the factory's public
  seam (``spec_name`` + ``spec_module_path``).
* :func:`faulty`, :func:`fill` - a ``FaultyTier`` under an Offloader, and
  blocks stored through it (the tier-engine and cache-control tests).
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch

from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, make_offload_key
from aiokvo.handlers.host import HostCopy, apply_host_copies
from aiokvo.keys import OffloadKey
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.offloading_spec import CPUOffloadingSpec
from aiokvo.specs import CPULoadStoreSpec, PrepareStoreOutput, ReqContext
from aiokvo.testing import FaultyStore, FaultyTier
from aiokvo.tiers.engine import StoreTier

PAGE = 64
BLOCK_TOKENS = 16


def key(name: str, group: int = 0) -> OffloadKey:
    return make_offload_key(hashlib.blake2b(name.encode(), digest_size=16).digest(), group)


def keys(*names: str, group: int = 0) -> list[OffloadKey]:
    return [key(n, group) for n in names]


class KV:
    """``groups`` KV groups of ``layers`` tensors of ``(num_blocks, PAGE)`` int8 each.

    With ``factor`` > 1 a key covers ``factor`` consecutive GPU blocks of the
    caller's list; each gets its own bytes (:meth:`page`).
    """

    def __init__(
        self, num_blocks: int = 64, *, layers: int = 2, groups: int = 1, factor: int = 1
    ) -> None:
        self.factor = factor
        self.layers = [
            [torch.zeros(num_blocks, PAGE, dtype=torch.int8) for _ in range(layers)]
            for _ in range(groups)
        ]
        self.caches = CanonicalKVCaches.from_engine(self.layers)

    @staticmethod
    def page(k: OffloadKey, layer: int, sub: int) -> np.ndarray:
        digest = hashlib.shake_128(bytes(k) + bytes([layer, sub])).digest(PAGE)
        return np.frombuffer(digest, dtype=np.int8)

    def write(self, blocks: Sequence[int], ks: Sequence[OffloadKey], group: int = 0) -> None:
        """"Compute" ``ks``: fill their GPU blocks (``factor`` per key) with their bytes."""
        for i, block in enumerate(blocks):
            k, sub = ks[i // self.factor], i % self.factor
            for layer, tensor in enumerate(self.layers[group]):
                tensor[block].numpy()[:] = self.page(k, layer, sub)

    def holds(self, blocks: Sequence[int], ks: Sequence[OffloadKey], group: int = 0) -> bool:
        """True if every GPU block holds exactly the bytes of its key."""
        factor = self.factor
        return all(
            np.array_equal(tensor[block].numpy(), self.page(ks[i // factor], layer, i % factor))
            for i, block in enumerate(blocks)
            for layer, tensor in enumerate(self.layers[group])
        )

    def config(self, cpu_blocks: int, **options: object) -> OffloadConfig:
        groups = len(self.layers)
        return OffloadConfig(
            gpu_block_sizes=(BLOCK_TOKENS,) * groups,
            hash_block_size=BLOCK_TOKENS,
            kv_bytes_per_block=self.caches.page_bytes_per_block,
            cpu_bytes_to_use=cpu_blocks * self.caches.page_bytes_per_block * self.factor,
            offloaded_block_size=BLOCK_TOKENS * self.factor if self.factor > 1 else None,
            **options,  # type: ignore[arg-type]
        )


def counting_config(kv: KV, cpu_blocks: int, **options: object) -> OffloadConfig:
    """A config whose spec is :class:`CountingSpec` (found by module path)."""
    return kv.config(
        cpu_blocks, spec_name="CountingSpec", spec_module_path=__name__, **options
    )


class Copies:
    """A host ``copy_fn``: runs the copy unless held at :attr:`gate` or told to fail.

    A copy waits while :attr:`gate` is clear; it fails when :attr:`fail_all`
    is set when it runs, when :attr:`fail_next` (then decremented) is
    positive, or by chance (``rate``, seeded); ``max_delay`` sleeps up to
    that long first. A failing copy writes some pages before raising
    (a torn copy). Runs on the handlers' dispatch threads, so it is thread-safe.
    """

    def __init__(self, *, rate: float = 0.0, seed: int = 0, max_delay: float = 0.0) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.rate = rate
        self.max_delay = max_delay
        self.fail_all = False
        self.fail_next = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.ran = 0
        self.failed = 0

    def __call__(self, copies: Sequence[HostCopy]) -> None:
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the copy gate")
        with self._lock:
            self.ran += 1
            fail = self._rng.random() < self.rate
            if self.fail_next > 0:
                self.fail_next -= 1
                fail = True
            delay = self._rng.random() * self.max_delay
        fail = fail or self.fail_all
        if delay:
            time.sleep(delay)
        if fail:
            with self._lock:
                self.failed += 1
            half = [c for i, c in enumerate(copies) if i % 2 == 0]
            apply_host_copies(half)  # a torn copy: some pages written, then the failure
            raise RuntimeError("injected copy failure")
        apply_host_copies(copies)


class CountingManager(CPUOffloadingManager):
    """A CPU manager that checks every completion against what is outstanding.

    Violations are recorded, not raised: the Offloader calls ``complete_*``
    from done-callbacks, where a raise would only reach the exception handler.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.open_stores: Counter[tuple[OffloadKey, ...]] = Counter()
        self.open_loads: Counter[tuple[OffloadKey, ...]] = Counter()
        self.completed_stores = 0
        self.completed_loads = 0
        self.violations: list[str] = []
        self.explode: Exception | None = None  # raised once by the next complete_*, after it ran

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, req_context)
        if out is not None and out.keys_to_store:
            self.open_stores[tuple(out.keys_to_store)] += 1
        return out

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        reservation = tuple(keys)
        if self.open_stores[reservation] <= 0:
            self.violations.append(f"complete_store of keys never reserved or done: {reservation}")
        self.open_stores[reservation] -= 1
        self.open_stores += Counter()  # drop zero counts
        self.completed_stores += 1
        super().complete_store(keys, success)
        self._maybe_explode()

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        spec = super().prepare_load(keys, req_context)
        if keys:
            self.open_loads[tuple(keys)] += 1
        return spec

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        pins = tuple(keys)
        if self.open_loads[pins] <= 0:
            self.violations.append(f"complete_load without a pending prepare_load: {pins}")
        self.open_loads[pins] -= 1
        self.open_loads += Counter()
        self.completed_loads += 1
        super().complete_load(keys)
        self._maybe_explode()

    def _maybe_explode(self) -> None:
        error, self.explode = self.explode, None
        if error is not None:
            raise error


class CountingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with a :class:`CountingManager` (store_threshold unused)."""

    def _build_manager(self) -> OffloadingManager:
        config = self.config
        return CountingManager(config.num_cpu_blocks, cache_policy=config.eviction_policy)


def names(prefix: str, n: int) -> list[OffloadKey]:
    return [key(f"{prefix}{i}") for i in range(n)]


def faulty(**settings: Any) -> StoreTier:
    """A fault-injecting tier of 64 blocks unless told otherwise."""
    settings.setdefault("capacity_blocks", 64)
    return FaultyTier(**settings)


def store_of(tier: StoreTier) -> FaultyStore:
    assert isinstance(tier.store, FaultyStore)
    return tier.store


async def fill(off: Offloader, kv: KV, ks: list[OffloadKey], start: int = 0) -> None:
    """Store ``ks`` from GPU blocks ``start...`` (written with their bytes), drained."""
    blocks = list(range(start, start + len(ks)))
    kv.write(blocks, ks)
    result = await off.store(ks, blocks)
    assert result.ok, result
    await off.drain()
