"""Live offload telemetry: manager events plus transfer results, aggregated per second.

Run:  python examples/telemetry.py [--seconds 3]

:class:`Telemetry` attaches to a manager (``manager.subscribe()``: blocks that
became readable, blocks evicted) and to a worker (``worker.get_finished()``:
bytes and copy time per direction). The scheduler adds what only it knows,
the outcome of each ``lookup_prefix``, with :meth:`Telemetry.record_lookup`.
``async for snap in telemetry.every(1.0)`` then yields a :class:`Snapshot`
per interval. Run on its own, this file drives a small random store/load
workload for a few seconds through the low-level API (one coroutine, so
awaiting between a lookup and its completion is safe here) and prints one
aggregate line per second. An :class:`aiokvo.Offloader` keeps these numbers
itself: ``examples/quickstart.py`` draws its progress line from
``off.statistics()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Self

import numpy as np
import torch

from aiokvo.config import OffloadConfig
from aiokvo.events import Lagged
from aiokvo.handlers.worker import OffloadingWorker
from aiokvo.keys import make_offload_key
from aiokvo.layout import CanonicalKVCaches
from aiokvo.manager.base import OffloadingManager
from aiokvo.offloading_spec import CPUOffloadingSpec
from aiokvo.runtime.run import run
from aiokvo.specs import GPULoadStoreSpec, ReqContext, TransferResult

STORE = ("GPU", "CPU")
LOAD = ("CPU", "GPU")


@dataclass(slots=True)
class Direction:
    """Transfers one way: how many, how many bytes, how long the copies took."""

    transfers: int = 0
    failed: int = 0
    bytes: int = 0
    copy_seconds: float = 0.0

    @property
    def copy_gbps(self) -> float:
        """Bandwidth while copying (bytes over summed copy time)."""
        return self.bytes / self.copy_seconds / 1e9 if self.copy_seconds else 0.0


@dataclass(slots=True)
class Snapshot:
    """Running totals at one instant (``at`` is ``time.perf_counter()``)."""

    at: float = 0.0
    looked_up_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    missed_events: int = 0
    store: Direction = field(default_factory=Direction)
    load: Direction = field(default_factory=Direction)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.looked_up_blocks if self.looked_up_blocks else 0.0

    def copy(self) -> Snapshot:
        return replace(self, store=replace(self.store), load=replace(self.load))

    def gbps_since(self, earlier: Snapshot) -> float:
        """Bytes moved (both ways) per wall-clock second since ``earlier``."""
        moved = self.store.bytes + self.load.bytes - earlier.store.bytes - earlier.load.bytes
        elapsed = self.at - earlier.at
        return moved / elapsed / 1e9 if elapsed > 0 else 0.0


class Telemetry:
    """Aggregates a manager's events and a worker's results; use ``async with``."""

    def __init__(self, manager: OffloadingManager, worker: OffloadingWorker) -> None:
        self._manager = manager
        self._worker = worker
        self._totals = Snapshot()
        self._tasks: list[asyncio.Task[None]] = []

    def record_lookup(self, hit_blocks: int, looked_up_blocks: int) -> None:
        """Count one ``lookup_prefix``: ``hit_blocks`` of ``looked_up_blocks`` were ready."""
        self._totals.hit_blocks += hit_blocks
        self._totals.looked_up_blocks += looked_up_blocks

    def snapshot(self) -> Snapshot:
        snap = self._totals.copy()
        snap.at = time.perf_counter()
        return snap

    async def every(self, interval: float) -> AsyncIterator[Snapshot]:
        """A snapshot every ``interval`` seconds, until the consumer stops."""
        while True:
            await asyncio.sleep(interval)
            yield self.snapshot()

    async def __aenter__(self) -> Self:
        subscription = self._manager.subscribe(maxsize=4096)
        self._subscription = subscription
        self._tasks = [
            asyncio.create_task(self._read_events(), name="telemetry-events"),
            asyncio.create_task(self._read_results(), name="telemetry-results"),
        ]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._subscription.close()  # the event reader drains what is buffered, then stops
        events, results = self._tasks
        await events
        results.cancel()  # the worker may outlive us; take what it has left
        with contextlib.suppress(asyncio.CancelledError):
            await results
        for result in self._worker.get_finished_nowait():
            self._count(result)

    async def _read_events(self) -> None:
        async for item in self._subscription:
            if isinstance(item, Lagged):
                self._totals.missed_events += item.missed
            elif item.removed:
                self._totals.evicted_blocks += len(item.keys)
            else:
                self._totals.stored_blocks += len(item.keys)

    async def _read_results(self) -> None:
        async for result in self._worker.get_finished():
            self._count(result)

    def _count(self, result: TransferResult) -> None:
        way = self._totals.store if result.transfer_type == STORE else self._totals.load
        way.transfers += 1
        if not result.success:
            way.failed += 1
            return
        way.bytes += result.transfer_size or 0
        way.copy_seconds += result.transfer_time or 0.0


def describe(snap: Snapshot, rate_gbps: float) -> str:
    """One human line for a snapshot."""
    return (
        f"hit {snap.hit_rate:6.1%}  stored {snap.stored_blocks:5d}  "
        f"evicted {snap.evicted_blocks:5d}  store {snap.store.bytes / 2**20:8.1f} MiB  "
        f"load {snap.load.bytes / 2**20:8.1f} MiB  {rate_gbps:5.2f} GB/s"
    )


# -- a small workload to watch ----------------------------------------------------------


async def _demo(seconds: float, pool_blocks: int) -> None:
    layers = [torch.zeros(2, 128, 16, 8, 64, dtype=torch.bfloat16) for _ in range(4)]
    kv = CanonicalKVCaches.from_engine(layers, layout="kv_first")
    config = OffloadConfig(
        gpu_block_sizes=(16,),
        hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block,
        cpu_bytes_to_use=pool_blocks * kv.page_bytes_per_block,
    )
    rng = np.random.default_rng(0)
    ctx = ReqContext()
    async with CPUOffloadingSpec(config) as spec, OffloadingWorker() as worker:
        for route in spec.get_handlers(kv):
            worker.register_handler(*route)
        manager = spec.get_manager()
        async with Telemetry(manager, worker) as telemetry:
            reporter = asyncio.create_task(_report(telemetry))
            deadline = time.perf_counter() + seconds
            job = 0
            while time.perf_counter() < deadline:
                # A "request" of 8 blocks drawn from 3x more distinct blocks than fit.
                ids = rng.choice(3 * pool_blocks, size=8, replace=False)
                keys = [make_offload_key(int(i).to_bytes(16, "big"), 0) for i in ids]
                hits = manager.lookup_prefix(keys, ctx) or 0
                telemetry.record_lookup(hits, len(keys))
                gpu_ids = rng.choice(128, size=8, replace=False)
                if hits:
                    job += 1
                    src = manager.prepare_load(keys[:hits], ctx)
                    dst = GPULoadStoreSpec(gpu_ids[:hits], [hits], [0])
                    await worker.transfer_async(job, (src, dst))
                    manager.complete_load(keys[:hits])
                out = manager.prepare_store(keys[hits:], ctx)
                if out is not None and out.keys_to_store:
                    job += 1
                    n = len(out.keys_to_store)
                    src_gpu = GPULoadStoreSpec(gpu_ids[:n], [n], [0])
                    result = await worker.transfer_async(job, (src_gpu, out.store_spec))
                    manager.complete_store(out.reservation, success=result.success)
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        final = telemetry.snapshot()
        print(f"final: {describe(final, 0.0)}")
        print(
            f"copy bandwidth: store {final.store.copy_gbps:.2f} GB/s, "
            f"load {final.load.copy_gbps:.2f} GB/s"
        )


async def _report(telemetry: Telemetry) -> None:
    last = telemetry.snapshot()
    async for snap in telemetry.every(1.0):
        print(describe(snap, snap.gbps_since(last)), flush=True)
        last = snap


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--pool-blocks", type=int, default=64)
    args = parser.parse_args(argv)
    run(_demo(args.seconds, args.pool_blocks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
