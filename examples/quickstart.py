"""aiokvo end to end: an async scheduler that offloads KV blocks to CPU and reloads them.

Run:  make demo     (or: python examples/quickstart.py --help)

The "GPU" KV cache here is a set of CPU tensors shaped like a real model's
(FlashAttention layout, bf16), so the demo runs anywhere on the host backend;
on a CUDA machine the same code would drive the CUDA backend. A stream of
requests reuses a set of shared prompt prefixes (system prompts, documents)
and adds a few blocks of its own. For every request the scheduler:

1. asks the manager how much of its prefix is offloaded (``lookup_prefix``),
2. loads those blocks back into fresh GPU blocks (``prepare_load`` ->
   ``transfer_async`` -> ``complete_load``) and checks them byte for byte
   against what was stored,
3. "computes" the rest (writes each block's deterministic KV bytes), and
4. offloads the new blocks (``prepare_store`` -> ``transfer_async`` ->
   ``complete_store``), which evicts older blocks when the CPU pool is full.

A telemetry task draws a live progress line from the manager's event stream
and the worker's results (see ``examples/telemetry.py``). The run ends with a
summary; any mismatch on reload makes it exit with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for the sibling telemetry.py

from telemetry import Snapshot, Telemetry

from aiokvo.config import OffloadConfig
from aiokvo.handlers.worker import OffloadingWorker
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.layout import CanonicalKVCaches
from aiokvo.manager.base import OffloadingManager
from aiokvo.offloading_spec import CPUOffloadingSpec
from aiokvo.runtime.run import run
from aiokvo.specs import GPULoadStoreSpec, ReqContext


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Async KV-offload scheduler simulation (host backend).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per GPU block")
    p.add_argument("--gpu-blocks", type=int, default=320)
    p.add_argument("--cpu-blocks", type=int, default=256, help="CPU pool, in blocks")
    p.add_argument("--prefixes", type=int, default=64, help="distinct shared prefixes")
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight")
    p.add_argument("--policy", choices=["lru", "arc"], default="lru")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# -- the workload --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    keys: list[OffloadKey]


def make_requests(args: argparse.Namespace) -> list[Request]:
    """Requests = a popular shared prefix (Zipf-like) + 1..4 blocks of their own."""
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(4, 13, size=args.prefixes)
    popularity = 1.0 / np.arange(1, args.prefixes + 1) ** 0.8
    popularity /= popularity.sum()
    requests = []
    for rid in range(args.requests):
        prefix = int(rng.choice(args.prefixes, p=popularity))
        chunks = [f"prefix{prefix}/{j}" for j in range(int(lengths[prefix]))]
        chunks += [f"request{rid}/{j}" for j in range(int(rng.integers(1, 5)))]
        requests.append(Request(rid, chain_keys(chunks)))
    return requests


def chain_keys(chunks: Sequence[str]) -> list[OffloadKey]:
    """Prefix-cache keys: each block's hash covers every token before it."""
    keys, parent = [], b""
    for chunk in chunks:
        parent = hashlib.blake2b(parent + chunk.encode(), digest_size=16).digest()
        keys.append(make_offload_key(parent, 0))
    return keys


class KVBytes:
    """The bytes a block's KV holds, derived from its key: "compute" and "verify".

    Each canonical tensor has a random base page; block ``k``'s page is that
    base rotated and offset by numbers taken from ``k``'s hash. Cheap to
    regenerate (numpy, no Python loop per block), and different for every
    block and tensor.
    """

    def __init__(self, kv: CanonicalKVCaches, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self._rows = [t.tensor.numpy().view(np.uint8) for t in kv.tensors]
        self._rotations = []
        for t in kv.tensors:
            base = rng.integers(0, 256, t.page_size_bytes, dtype=np.uint8)
            # every rotation of base is a row of this (page + 1, page) view
            doubled = np.concatenate([base, base])
            self._rotations.append(sliding_window_view(doubled, t.page_size_bytes))

    def _expected(self, idx: int, keys: Sequence[OffloadKey]) -> np.ndarray:
        words = np.array([int.from_bytes(k[:8], "little") for k in keys], dtype=np.uint64)
        rotations = self._rotations[idx]
        shift = (words % np.uint64(rotations.shape[1])).astype(np.intp)
        offset = ((words >> np.uint64(32)) % np.uint64(255) + np.uint64(1)).astype(np.uint8)
        rows = rotations[shift]  # a copy
        rows += offset[:, None]
        return rows

    def compute(self, gpu_ids: list[int], keys: Sequence[OffloadKey]) -> None:
        for idx, rows in enumerate(self._rows):
            rows[gpu_ids] = self._expected(idx, keys)

    def matches(self, gpu_ids: list[int], keys: Sequence[OffloadKey]) -> bool:
        return all(
            np.array_equal(rows[gpu_ids], self._expected(idx, keys))
            for idx, rows in enumerate(self._rows)
        )


class GPUBlocks:
    """A free list of GPU block ids; requests wait when it runs dry."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count))
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    async def give_back(self, ids: list[int]) -> None:
        async with self._changed:
            self._free += ids
            self._changed.notify_all()


@dataclass(slots=True)
class Stats:
    requests: int = 0
    loaded_blocks: int = 0
    verified: int = 0
    mismatched: int = 0
    failed_transfers: int = 0
    retries: int = 0


# -- the scheduler ---------------------------------------------------------------------


class Scheduler:
    def __init__(
        self,
        manager: OffloadingManager,
        worker: OffloadingWorker,
        kv_bytes: KVBytes,
        gpu: GPUBlocks,
        telemetry: Telemetry,
    ) -> None:
        self.manager, self.worker, self.kv_bytes = manager, worker, kv_bytes
        self.gpu, self.telemetry = gpu, telemetry
        self.stats = Stats()
        self._next_job = 0
        self._ctx = ReqContext()

    def _job(self) -> int:
        self._next_job += 1
        return self._next_job

    async def serve(self, request: Request) -> None:
        keys, ctx = request.keys, self._ctx
        # 1. How much of the prefix is offloaded? None: a store of it is in flight.
        while (hits := self.manager.lookup_prefix(keys, ctx)) is None:
            self.stats.retries += 1
            await asyncio.sleep(0.001)
        self.telemetry.record_lookup(hits, len(keys))
        gpu_ids = await self.gpu.take(len(keys))
        try:
            # 2. Load the offloaded prefix into fresh GPU blocks and verify it.
            if hits:
                src = self.manager.prepare_load(keys[:hits], ctx)
                dst = GPULoadStoreSpec(gpu_ids[:hits], group_sizes=[hits], block_indices=[0])
                result = await self.worker.transfer_async(self._job(), (src, dst))
                self.manager.complete_load(keys[:hits])
                if result.success:
                    self.stats.loaded_blocks += hits
                    if self.kv_bytes.matches(gpu_ids[:hits], keys[:hits]):
                        self.stats.verified += hits
                    else:
                        self.stats.mismatched += hits
                else:
                    self.stats.failed_transfers += 1
                    hits = 0  # recompute everything
            # 3. "Compute" the rest of the request's KV.
            self.kv_bytes.compute(gpu_ids[hits:], keys[hits:])
            # 4. Offload what the pool does not hold yet (evicting if it must).
            out = self.manager.prepare_store(keys[hits:], ctx)
            if out is not None and out.keys_to_store:
                slot = {k: g for k, g in zip(keys, gpu_ids, strict=True)}
                src_ids = [slot[k] for k in out.keys_to_store]
                src_gpu = GPULoadStoreSpec(
                    src_ids, [len(src_ids)], [keys.index(out.keys_to_store[0])]
                )
                result = await self.worker.transfer_async(self._job(), (src_gpu, out.store_spec))
                self.manager.complete_store(out.keys_to_store, success=result.success)
                if not result.success:
                    self.stats.failed_transfers += 1
        finally:
            await self.gpu.give_back(gpu_ids)
        self.stats.requests += 1


# -- progress and summary ----------------------------------------------------------------


async def show_progress(telemetry: Telemetry, stats: Stats, total: int) -> None:
    """Redraw one line in place on a terminal; print a plain line per second otherwise."""
    tty = sys.stdout.isatty()
    window = [telemetry.snapshot()]  # the last second of snapshots, for the rate

    def draw(snap: Snapshot) -> None:
        done = stats.requests
        bar = "#" * (30 * done // total)
        line = (
            f"[{bar:<30}] {done:4d}/{total} req  hit {snap.hit_rate:6.1%}  "
            f"{snap.gbps_since(window[0]):5.2f} GB/s  evicted {snap.evicted_blocks}"
        )
        print(f"\r{line}\x1b[K" if tty else line, end="" if tty else "\n", flush=True)

    try:
        async for snap in telemetry.every(0.1 if tty else 1.0):
            draw(snap)
            window = [*window[-9:], snap] if tty else [snap]
    finally:
        if tty:  # leave the finished bar on screen
            draw(telemetry.snapshot())
            print()


def print_summary(args: argparse.Namespace, snap: Snapshot, stats: Stats, wall: float) -> None:
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    rows = [
        ("requests", f"{stats.requests} in {wall:.1f} s ({args.concurrency} in flight)"),
        ("hit rate", f"{snap.hit_rate:.1%} of {snap.looked_up_blocks} blocks looked up"),
        ("blocks stored", f"{snap.stored_blocks}"),
        ("blocks loaded", f"{stats.loaded_blocks}"),
        ("blocks evicted", f"{snap.evicted_blocks}"),
        (
            "GPU -> CPU",
            f"{gib(snap.store.bytes)} in {snap.store.transfers} transfers, "
            f"{snap.store.copy_gbps:.2f} GB/s while copying",
        ),
        (
            "CPU -> GPU",
            f"{gib(snap.load.bytes)} in {snap.load.transfers} transfers, "
            f"{snap.load.copy_gbps:.2f} GB/s while copying",
        ),
        ("failed transfers", f"{stats.failed_transfers}"),
        ("lookups retried", f"{stats.retries} (a store of the prefix was in flight)"),
        ("verified", f"{stats.verified}/{stats.loaded_blocks}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


async def main_async(args: argparse.Namespace, **handler_options: Any) -> int:
    # The engine's KV cache: per layer, K and V stacked in front (FlashAttention).
    shape = (2, args.gpu_blocks, args.block_tokens, args.kv_heads, args.head_dim)
    layers = {
        f"layers.{i}.attn": torch.zeros(shape, dtype=torch.bfloat16) for i in range(args.layers)
    }
    kv = CanonicalKVCaches.from_engine(layers, layout="kv_first")
    block_bytes = kv.page_bytes_per_block
    config = OffloadConfig(
        gpu_block_sizes=(args.block_tokens,),
        hash_block_size=args.block_tokens,
        kv_bytes_per_block=block_bytes,
        cpu_bytes_to_use=args.cpu_blocks * block_bytes,
        eviction_policy=args.policy,
    )
    requests = make_requests(args)
    working_set = len({k for r in requests for k in r.keys})
    print(
        f"aiokvo quickstart: {args.layers} layers x (K, V), {args.kv_heads} KV heads x "
        f"{args.head_dim} dims, bf16, {args.block_tokens}-token blocks "
        f"({block_bytes // 1024} KiB per block)\n"
        f"  GPU: {args.gpu_blocks} blocks ({args.gpu_blocks * block_bytes / 2**20:.0f} MiB)   "
        f"CPU pool: {config.num_cpu_blocks} blocks ({config.cpu_bytes_to_use / 2**20:.0f} MiB, "
        f"{args.policy})   working set: {working_set} blocks, {len(requests)} requests"
    )

    kv_bytes = KVBytes(kv, args.seed)
    started = time.perf_counter()
    spec = CPUOffloadingSpec(config, handler_options=handler_options)
    async with spec, OffloadingWorker() as worker:
        for route in spec.get_handlers(kv):
            worker.register_handler(*route)
        manager = spec.get_manager()
        async with Telemetry(manager, worker) as telemetry:
            scheduler = Scheduler(manager, worker, kv_bytes, GPUBlocks(args.gpu_blocks), telemetry)
            progress = asyncio.create_task(show_progress(telemetry, scheduler.stats, len(requests)))
            queue: asyncio.Queue[Request] = asyncio.Queue()
            for request in requests:
                queue.put_nowait(request)

            async def serve_queue() -> None:
                while not queue.empty():
                    await scheduler.serve(queue.get_nowait())

            async with asyncio.TaskGroup() as group:
                for _ in range(args.concurrency):
                    group.create_task(serve_queue())
            progress.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await progress
        wall = time.perf_counter() - started
    stats = scheduler.stats
    print_summary(args, telemetry.snapshot(), stats, wall)
    if stats.mismatched or stats.verified != stats.loaded_blocks:
        print(f"FAILED: {stats.mismatched} reloaded blocks differ from what was stored")
        return 1
    return 0


def main(argv: Sequence[str] | None = None, **handler_options: Any) -> int:
    """Run the demo; ``handler_options`` go to the host handlers (e.g. a ``copy_fn``)."""
    return run(main_async(parse_args(argv), **handler_options))


if __name__ == "__main__":
    raise SystemExit(main())
