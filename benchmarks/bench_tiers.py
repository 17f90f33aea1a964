"""The disk tier against the disk's own ceiling, and what it buys a prefix-reuse stream.

Run:  .venv/bin/python benchmarks/bench_tiers.py [--dir DIR] [--mib 512] [--rounds 3]

1. **Throughput, side by side on one directory.** For each block size, the
   same CPU-pool rows are written and read back four ways, interleaved in
   every round: raw ``os.pwritev`` / ``os.preadv`` of each block at its
   offset in one file (the ceiling: no checksum, no index), then the disk
   tier's ``(CPU, DISK)`` and ``(DISK, CPU)`` transfers through the worker
   (xxh3 checksums computed and verified, index entries committed). Both use
   O_DIRECT when the tier does (it probes the filesystem). The ratio tier/raw
   is reported per round; the headline is the median.
2. **Replay.** A Zipf prefix-reuse stream whose working set is 10x the CPU
   pool, served by an Offloader with the CPU pool alone, then with a disk
   tier below it: hit rate and requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import aiokvo
from aiokvo import CanonicalKVCaches, CPULoadStoreSpec, OffloadConfig, Offloader, make_offload_key
from aiokvo.tiers import DiskTier
from aiokvo.tiers.disk.files import FileIO, read_all, write_all

TENSORS = 2  # K and V: two iovecs per block


def layout(block_bytes: int, gpu_blocks: int = 4) -> CanonicalKVCaches:
    page = block_bytes // TENSORS
    return CanonicalKVCaches.from_engine(
        [torch.zeros(gpu_blocks, page, dtype=torch.int8) for _ in range(TENSORS)]
    )


async def throughput(root: Path, block_bytes: int, total: int, rounds: int) -> list[str]:
    n = total // block_bytes
    kv = layout(block_bytes)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block, cpu_bytes_to_use=n * block_bytes,
    )  # fmt: skip
    keys = [make_offload_key(hashlib.sha256(b"%d" % i).digest(), 0) for i in range(n)]
    tier = DiskTier(
        root, capacity_bytes=2 * n * block_bytes, model_id=f"bench-{block_bytes}",
        refresh_interval=0,
    )  # fmt: skip
    lines = []
    async with Offloader(config, kv, tiers=[tier]) as off:
        assert off.spec is not None
        pool = off.spec.cpu_tensors  # type: ignore[attr-defined]
        for t in pool:
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8))
        stats = tier.statistics()
        direct = stats.direct_io
        rows = [[t.numpy()[b] for t in pool] for b in range(n)]
        raw_path = tier.directory.parent / f"raw-{block_bytes}.dat"
        io = FileIO()
        ids = CPULoadStoreSpec(np.arange(n))
        job = [10_000_000]

        def raw_write() -> float:
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
            fd = os.open(raw_path, flags, 0o600)
            try:
                start = time.perf_counter()
                for b in range(n):
                    write_all(io, fd, rows[b], b * stats.slot_bytes)
                return time.perf_counter() - start
            finally:
                os.close(fd)

        def raw_read() -> float:
            fd = os.open(raw_path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                start = time.perf_counter()
                for b in range(n):
                    read_all(io, fd, rows[b], b * stats.slot_bytes)
                return time.perf_counter() - start
            finally:
                os.close(fd)

        async def tier_write() -> float:
            store = tier.prepare_store(keys)
            assert store is not None and len(store.keys) == n
            job[0] += 1
            start = time.perf_counter()
            result = await off.worker.transfer_async(job[0], (ids, store.spec))
            elapsed = time.perf_counter() - start
            tier.complete_store(store, result)
            assert result.success, result
            return elapsed

        async def tier_read() -> float:
            load = tier.prepare_load(keys)
            assert load is not None
            job[0] += 1
            start = time.perf_counter()
            result = await off.worker.transfer_async(job[0], (load.spec, ids))
            elapsed = time.perf_counter() - start
            assert len(tier.complete_load(load, result)) == n and result.success, result
            return elapsed

        async def evict_all() -> None:  # fresh slots each round, as the raw file is fresh
            state = tier.state
            state.slots.remove(list(state.own_keys()))
            for key in list(state.own_keys()):
                state._own.pop(key, None)

        loop = asyncio.get_running_loop()
        ratios_w, ratios_r = [], []
        for r in range(rounds):
            await evict_all()
            rw = await loop.run_in_executor(None, raw_write)
            tw = await tier_write()
            rr = await loop.run_in_executor(None, raw_read)
            tr = await tier_read()
            gb = n * block_bytes / 1e9
            ratios_w.append(rw / tw)
            ratios_r.append(rr / tr)
            lines.append(
                f"| {block_bytes // 1024} KiB | {r + 1} | {gb / rw:.2f} | {gb / tw:.2f} | "
                f"{rw / tw:.2f}x | {gb / rr:.2f} | {gb / tr:.2f} | {rr / tr:.2f}x |"
            )
        lines.append(
            f"| {block_bytes // 1024} KiB | median | | | **{statistics.median(ratios_w):.2f}x** "
            f"| | | **{statistics.median(ratios_r):.2f}x** |"
        )
        raw_path.unlink()
    return lines, direct  # type: ignore[return-value]


async def replay(root: Path | None, *, pool: int, requests: int, seed: int) -> tuple[float, float]:
    block = 64 << 10
    kv = layout(block, gpu_blocks=64)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block, cpu_bytes_to_use=pool * block,
    )  # fmt: skip
    rng = random.Random(seed)
    prefixes = [[make_offload_key(hashlib.sha256(b"p%d-%d" % (p, i)).digest(), 0)
                 for i in range(8)] for p in range(10 * pool // 8)]  # fmt: skip
    weights = [1 / (i + 1) ** 0.8 for i in range(len(prefixes))]
    stream = []
    for r in range(requests):
        prefix = rng.choices(prefixes, weights)[0]
        tail = [make_offload_key(hashlib.sha256(b"t%d-%d" % (r, i)).digest(), 0) for i in range(2)]
        stream.append(prefix + tail)
    tiers = [] if root is None else [
        DiskTier(root, capacity_bytes=12 * pool * block + (1 << 20), model_id="bench-replay",
                 refresh_interval=0)
    ]  # fmt: skip
    async with Offloader(config, kv, tiers=tiers) as off:
        start = time.perf_counter()
        for keys in stream:
            ids = list(range(len(keys)))
            await off.load_prefix(keys, ids)
            await off.store(keys, ids)
        elapsed = time.perf_counter() - start
        snap = off.statistics()
    hit = snap.hit_blocks / (snap.hit_blocks + snap.miss_blocks)
    return hit, requests / elapsed


async def main_async(args: argparse.Namespace) -> None:
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="aiokvo-bench-"))
    base.mkdir(mode=0o700, exist_ok=True)
    print(f"# bench_tiers: {args.mib} MiB per pass, {args.rounds} rounds, in {base}")
    print(f"# {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs\n")
    print("| block | round | raw write GB/s | tier write GB/s | write ratio | raw read GB/s "
          "| tier read GB/s | read ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    direct = False
    for kib in args.blocks:
        lines, direct = await throughput(base / f"t{kib}", kib << 10, args.mib << 20, args.rounds)
        print("\n".join(lines))
    print(f"\nO_DIRECT: {direct}\n")
    print("| replay (working set 10x the CPU pool) | hit rate | requests/s |")
    print("|---|---|---|")
    for name, root in (("CPU pool alone", None), ("CPU pool + disk tier", base / "replay")):
        hit, rate = await replay(root, pool=args.pool, requests=args.requests, seed=0)
        print(f"| {name} | {hit:.1%} | {rate:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory on the disk to measure")
    p.add_argument("--mib", type=int, default=512, help="MiB written and read per pass")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 1024], help="KiB")
    p.add_argument("--pool", type=int, default=64, help="CPU pool blocks for the replay")
    p.add_argument("--requests", type=int, default=600)
    aiokvo.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
