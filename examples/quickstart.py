"""aiokvo end to end: an async scheduler that offloads KV blocks to CPU and reloads them.

Run:  make demo     (or: python examples/quickstart.py --help)

The "GPU" KV cache here is a set of CPU tensors shaped like a real model's
(FlashAttention layout, bf16), so the demo runs anywhere on the host backend;
on a CUDA machine the same code would drive the CUDA backend. A stream of
requests reuses a set of shared prompt prefixes (system prompts, documents)
and adds a few blocks of its own; ``--concurrency`` of them are served at
once, by as many coroutines. For every request the scheduler makes two
calls to one :class:`aiokvo.Offloader`:

1. ``n = await off.load_prefix(keys, gpu_blocks)`` loads the longest
   offloaded prefix into the request's GPU blocks (waiting for a store of
   that prefix still in flight, if another request is writing it), and the
   demo checks those ``n`` blocks byte for byte against what was stored;
2. it "computes" the rest (writes each block's deterministic KV bytes), and
   ``await off.store(keys, gpu_blocks)`` offloads what the pool does not hold
   yet, evicting older blocks when the CPU pool is full.

Below the CPU pool sits a disk tier (``DiskTier``, in a temporary
directory; ``--no-disk`` turns it off): every block the pool takes is
written through to it, so a block evicted from the pool is promoted back
from disk by the next ``load_prefix`` that needs it, checksum-verified. The
summary reports hits per tier.

``--mooncake HOST:PORT`` adds the distributed tier (``MooncakeTier``) on
the Mooncake cluster whose master is there; ``--mooncake local`` starts a
throwaway one on loopback first (a master and ``--mooncake-nodes`` storage
processes) and stops it at the end. With ``--replicas N`` the requests are
served by N engine replicas, each with its own KV cache, CPU pool and disk
tier: only the cluster is shared, so a prefix one replica computed is a
Mooncake hit for the others.

Lookups, pins, job ids, reservations and every ``complete_*`` are the
Offloader's business, so this is safe at any concurrency. A live progress
line is drawn from ``off.statistics()``; the run ends with a summary, and
any mismatch on reload makes it exit with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

import aiokvo
from aiokvo import (
    CanonicalKVCaches,
    OffloadConfig,
    Offloader,
    OffloaderStatistics,
    OffloadKey,
    make_offload_key,
)
from aiokvo.testing import LocalCluster
from aiokvo.tiers import DiskTier, MooncakeTier, Tier


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
    p.add_argument("--concurrency", type=int, default=8, help="requests served at once")
    p.add_argument("--policy", choices=["lru", "arc"], default="lru")
    p.add_argument(
        "--disk", action=argparse.BooleanOptionalAction, default=True,
        help="a disk tier below the CPU pool (in a temporary directory unless --disk-dir)",
    )  # fmt: skip
    p.add_argument("--disk-dir", default=None, help="directory for the disk tier")
    p.add_argument("--disk-blocks", type=int, default=1024, help="disk tier, in blocks")
    p.add_argument("--admit-after", type=int, default=1, help="offers before a disk write")
    p.add_argument(
        "--mooncake", default=None, metavar="local|HOST:PORT",
        help="a Mooncake tier: the cluster whose master is HOST:PORT, or 'local' to start one",
    )  # fmt: skip
    p.add_argument("--mooncake-metadata", default="P2PHANDSHAKE", help="its metadata server")
    p.add_argument("--mooncake-nodes", type=int, default=1, help="storage nodes of 'local'")
    p.add_argument("--mooncake-segment-mib", type=int, default=256, help="MiB per local node")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas sharing the tiers")
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
    """What only the scheduler knows: requests served and what the reloads held."""

    requests: int = 0
    loaded_blocks: int = 0
    verified: int = 0
    mismatched: int = 0


# -- the scheduler ---------------------------------------------------------------------


class Scheduler:
    def __init__(self, off: Offloader, kv_bytes: KVBytes, gpu: GPUBlocks) -> None:
        self.off, self.kv_bytes, self.gpu = off, kv_bytes, gpu
        self.stats = Stats()

    async def serve(self, request: Request) -> None:
        keys = request.keys
        gpu_ids = await self.gpu.take(len(keys))
        try:
            # 1. Load the offloaded prefix into the request's GPU blocks, and verify it.
            hits = await self.off.load_prefix(keys, gpu_ids)
            if hits:
                self.stats.loaded_blocks += hits
                if self.kv_bytes.matches(gpu_ids[:hits], keys[:hits]):
                    self.stats.verified += hits
                else:
                    self.stats.mismatched += hits
            # 2. "Compute" the rest of the request's KV, then offload what the pool lacks.
            self.kv_bytes.compute(gpu_ids[hits:], keys[hits:])
            await self.off.store(keys, gpu_ids)
        finally:
            await self.gpu.give_back(gpu_ids)
        self.stats.requests += 1


# -- progress and summary ----------------------------------------------------------------


def hit_rate(snap: OffloaderStatistics) -> float:
    asked = snap.hit_blocks + snap.miss_blocks
    return snap.hit_blocks / asked if asked else 0.0


async def show_progress(off: Offloader, schedulers: list[Scheduler], total: int) -> None:
    """Redraw one line in place on a terminal; print a plain line per second otherwise.

    The rates are the first replica's (``off``); the request count is everyone's.
    """
    tty = sys.stdout.isatty()
    # Recent (time, snapshot) pairs: the rate is taken over about the last second.
    window: deque[tuple[float, OffloaderStatistics]] = deque(maxlen=10 if tty else 1)
    window.append((time.perf_counter(), off.statistics()))

    def draw(now: float, snap: OffloaderStatistics) -> None:
        then, old = window[0]
        moved = snap.load_bytes + snap.store_bytes - old.load_bytes - old.store_bytes
        gbps = moved / (now - then) / 1e9 if now > then else 0.0
        done = sum(s.stats.requests for s in schedulers)
        line = (
            f"[{'#' * (30 * done // total):<30}] {done:4d}/{total} req  "
            f"hit {hit_rate(snap):6.1%}  {gbps:5.2f} GB/s  evicted {snap.blocks_evicted}  "
            f"copies in flight {snap.loads_in_flight + snap.stores_in_flight}"
        )
        print(f"\r{line}\x1b[K" if tty else line, end="" if tty else "\n", flush=True)

    try:
        while True:
            await asyncio.sleep(0.1 if tty else 1.0)
            now, snap = time.perf_counter(), off.statistics()
            draw(now, snap)
            window.append((now, snap))
    finally:
        if tty:  # leave the finished bar on screen
            draw(time.perf_counter(), off.statistics())
            print()


def print_summary(
    args: argparse.Namespace, snap: OffloaderStatistics, stats: Stats, wall: float
) -> None:
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    def gbps(n: int, seconds: float) -> str:
        return f"{n / seconds / 1e9 if seconds else 0.0:.2f} GB/s"

    asked = snap.hit_blocks + snap.miss_blocks
    by_tier = ", ".join(f"{medium} {n}" for medium, n in snap.hits_by_medium.items())
    rows = [
        ("requests", f"{stats.requests} in {wall:.1f} s ({args.concurrency} in flight)"),
        ("hit rate", f"{hit_rate(snap):.1%} of {asked} blocks looked up"),
        ("hits by tier", by_tier),
        ("blocks stored", f"{snap.blocks_stored} ({snap.blocks_skipped} already held)"),
        ("blocks loaded", f"{stats.loaded_blocks}"),
        ("blocks evicted", f"{snap.blocks_evicted}"),
        (
            "GPU -> CPU",
            f"{gib(snap.store_bytes)} in {snap.store_transfers} transfers, "
            f"{gbps(snap.store_bytes, snap.store_seconds)} while copying",
        ),
        (
            "CPU -> GPU",
            f"{gib(snap.load_bytes)} in {snap.load_transfers} transfers, "
            f"{gbps(snap.load_bytes, snap.load_seconds)} while copying",
        ),
        ("failed transfers", f"{snap.load_transfer_failures + snap.store_transfer_failures}"),
        ("store waits", f"{snap.store_waits} (a load waited for its prefix's store)"),
        *_tier_rows(snap),
        ("verified", f"{stats.verified}/{stats.loaded_blocks}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def _tier_rows(snap: OffloaderStatistics) -> list[tuple[str, str]]:
    rows = []
    for tier in snap.tiers:
        if tier.capacity_blocks:
            held = f"{tier.used_blocks}/{tier.capacity_blocks} held, {tier.evictions} evicted"
        else:  # a distributed tier: the cluster places and evicts
            held = f"{tier.used_blocks} seen in the cluster, {tier.read_failures} misses on read"
        rows.append((
            f"{tier.medium.lower()} tier",
            f"{tier.blocks_written} written ({tier.bytes_written / 2**20:.0f} MiB), "
            f"{tier.blocks_read} promoted, {held}, {tier.checksum_failures} checksum "
            f"failures, breaker {tier.breaker.state}",
        ))  # fmt: skip
    return rows


async def main_async(args: argparse.Namespace, **handler_options: object) -> int:
    with contextlib.ExitStack() as stack:
        disk_dir = args.disk_dir
        if args.disk and disk_dir is None:
            disk_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="aiokvo-demo-"))
        mooncake: dict[str, object] | None = None
        if args.mooncake == "local":
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own INFO lines
            segment = args.mooncake_segment_mib << 20
            cluster = stack.enter_context(LocalCluster(args.mooncake_nodes, segment_size=segment))
            mooncake = cluster.tier_settings()
            print(
                f"  started a local Mooncake cluster: master {cluster.master_server_addr}, "
                f"{args.mooncake_nodes} x {args.mooncake_segment_mib} MiB storage nodes"
            )
        elif args.mooncake is not None:
            mooncake = {"master_server_addr": args.mooncake,
                        "metadata_server": args.mooncake_metadata}  # fmt: skip
        return await run(args, disk_dir if args.disk else None, mooncake, **handler_options)


async def run(
    args: argparse.Namespace,
    disk_dir: str | None,
    mooncake: dict[str, object] | None,
    **handler_options: object,
) -> int:
    replicas = []
    for i in range(args.replicas):
        replicas.append(make_replica(args, i, disk_dir, mooncake, handler_options))
    requests = make_requests(args)
    working_set = len({k for r in requests for k in r.keys})
    first = replicas[0]
    block_bytes = first.kv.page_bytes_per_block
    print(
        f"aiokvo quickstart: {args.layers} layers x (K, V), {args.kv_heads} KV heads x "
        f"{args.head_dim} dims, bf16, {args.block_tokens}-token blocks "
        f"({block_bytes // 1024} KiB per block)\n"
        f"  GPU: {args.gpu_blocks} blocks ({args.gpu_blocks * block_bytes / 2**20:.0f} MiB)   "
        f"CPU pool: {first.config.num_cpu_blocks} blocks "
        f"({first.config.cpu_bytes_to_use / 2**20:.0f} MiB, {args.policy})   "
        f"working set: {working_set} blocks, {len(requests)} requests"
    )
    if disk_dir is not None:
        print(f"  disk tier: {args.disk_blocks} blocks in {disk_dir}"
              + (" (one directory per replica)" if args.replicas > 1 else ""))  # fmt: skip
    if mooncake is not None:
        print(f"  Mooncake tier: master {mooncake['master_server_addr']}"
              + (f", shared by {args.replicas} replicas" if args.replicas > 1 else ""))  # fmt: skip
    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        for replica in replicas:
            await stack.enter_async_context(replica.off)
        schedulers = [Scheduler(r.off, r.kv_bytes, GPUBlocks(args.gpu_blocks)) for r in replicas]
        progress = asyncio.create_task(show_progress(first.off, schedulers, len(requests)))
        queue: asyncio.Queue[Request] = asyncio.Queue()
        for request in requests:
            queue.put_nowait(request)

        async def serve_queue() -> None:
            while not queue.empty():
                request = queue.get_nowait()
                await schedulers[request.rid % len(schedulers)].serve(request)

        async with asyncio.TaskGroup() as group:
            for _ in range(args.concurrency):
                group.create_task(serve_queue())
        progress.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await progress
        wall = time.perf_counter() - started
        snaps = [r.off.statistics() for r in replicas]
    failed = 0
    for i, (snap, scheduler) in enumerate(zip(snaps, schedulers, strict=True)):
        if len(replicas) > 1:
            print(f"replica {i}:")
        stats = scheduler.stats
        print_summary(args, snap, stats, wall)
        if stats.mismatched or stats.verified != stats.loaded_blocks:
            print(f"FAILED: {stats.mismatched} reloaded blocks differ from what was stored")
            failed += 1
    return 1 if failed else 0


@dataclass(slots=True)
class Replica:
    """One engine replica: its KV cache, its CPU pool and tiers (the Offloader)."""

    kv: CanonicalKVCaches
    config: OffloadConfig
    kv_bytes: KVBytes
    off: Offloader


def make_replica(
    args: argparse.Namespace,
    index: int,
    disk_dir: str | None,
    mooncake: dict[str, object] | None,
    handler_options: dict[str, object],
) -> Replica:
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
    tiers: list[Tier] = []
    if disk_dir is not None:
        root = disk_dir if args.replicas == 1 else os.path.join(disk_dir, f"replica{index}")
        tiers.append(DiskTier(
            root,
            capacity_bytes=args.disk_blocks * block_bytes + (1 << 20),
            model_id="aiokvo-quickstart",
            admit_after=args.admit_after,
        ))  # fmt: skip
    if mooncake is not None:
        tiers.append(MooncakeTier(model_id="aiokvo-quickstart", **mooncake))  # type: ignore[arg-type]
    off = Offloader(config, kv, handler_options=handler_options, tiers=tiers)
    return Replica(kv, config, KVBytes(kv, args.seed), off)


def main(argv: Sequence[str] | None = None, **handler_options: object) -> int:
    """Run the demo; ``handler_options`` go to the host handlers (e.g. a ``copy_fn``)."""
    return aiokvo.run(main_async(parse_args(argv), **handler_options))


if __name__ == "__main__":
    raise SystemExit(main())
