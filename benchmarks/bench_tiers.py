"""The tiers against their own ceilings, and what they buy a prefix-reuse stream.

Run:  .venv/bin/python benchmarks/bench_tiers.py [--dir DIR] [--mib 512] [--rounds 3]
                                                 [--max-io-bytes N] [--read-threads N] [--no-disk]
                                                 [--mooncake local|HOST:PORT|off]

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
3. **Mooncake throughput, side by side on one cluster** (``--mooncake local``,
   the default when Mooncake is installed, starts a loopback cluster: one
   storage-node process; ``HOST:PORT`` uses a running master with P2P
   metadata). The same CPU-pool rows (one canonical tensor, so a block is one
   buffer) are put and got four ways, interleaved in every round, fresh keys
   each round: raw ``batch_put_from`` / ``batch_get_into`` of each row's KV
   bytes on the tier's own client (no checksum, no trailer), then the
   Mooncake tier's ``(CPU, MOONCAKE)`` and ``(MOONCAKE, CPU)`` transfers
   through the worker (trailers and xxh3 checksums written and verified; each
   trailer in the room after its row, so also one buffer per block). Ratio
   per round, median as the headline.
4. **Cross-instance hits.** Two engine replicas (two Offloaders, each with its
   own small CPU pool) replay overlapping prefix traces (one Zipf population
   of shared prefixes, each replica its own draw), interleaved: hit rate of
   each with its CPU pool alone, then with one Mooncake tier below both.
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
from aiokvo.keys import OffloadKey
from aiokvo.tiers import DiskTier, Tier
from aiokvo.tiers.disk.files import FileIO, read_all, write_all
from aiokvo.tiers.disk.runs import DEFAULT_MAX_IO_BYTES, DEFAULT_READ_THREADS
from aiokvo.tiers.slot_index import SlotIndex

TENSORS = 2  # K and V: two iovecs per block


def layout(block_bytes: int, gpu_blocks: int = 4) -> CanonicalKVCaches:
    page = block_bytes // TENSORS
    return CanonicalKVCaches.from_engine(
        [torch.zeros(gpu_blocks, page, dtype=torch.int8) for _ in range(TENSORS)]
    )


async def tier_write(
    off: Offloader, tier: Tier, keys: list[OffloadKey], ids: CPULoadStoreSpec, job: list[int]
) -> float:
    """Seconds one (CPU, tier) transfer of every key from the pool rows ``ids`` takes."""
    store = tier.prepare_store(keys)
    assert store is not None and len(store.keys) == len(keys)
    job[0] += 1
    start = time.perf_counter()
    result = await off.worker.transfer_async(job[0], (ids, store.spec))
    elapsed = time.perf_counter() - start
    tier.complete_store(store, result)
    assert result.success, result
    return elapsed


async def tier_read(
    off: Offloader, tier: Tier, keys: list[OffloadKey], ids: CPULoadStoreSpec, job: list[int]
) -> float:
    """Seconds one (tier, CPU) transfer of every key into the pool rows ``ids`` takes."""
    load = tier.prepare_load(keys)
    assert load is not None
    job[0] += 1
    start = time.perf_counter()
    result = await off.worker.transfer_async(job[0], (load.spec, ids))
    elapsed = time.perf_counter() - start
    assert len(tier.complete_load(load, result)) == len(keys) and result.success, result
    return elapsed


async def throughput(
    root: Path, block_bytes: int, total: int, rounds: int, **tier_options: int
) -> list[str]:
    n = total // block_bytes
    kv = layout(block_bytes)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block, cpu_bytes_to_use=n * block_bytes,
    )  # fmt: skip
    keys = [make_offload_key(hashlib.sha256(b"%d" % i).digest(), 0) for i in range(n)]
    tier = DiskTier(
        root, capacity_bytes=2 * n * block_bytes, model_id=f"bench-{block_bytes}",
        refresh_interval=0, **tier_options,
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
        raw_path = tier.store.directory.parent / f"raw-{block_bytes}.dat"
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

        async def evict_all() -> None:  # fresh slots each round, as the raw file is fresh
            index = tier.index
            assert isinstance(index, SlotIndex)
            index.slots.remove(list(index.own_keys()))
            for key in list(index.own_keys()):
                index._own.pop(key, None)

        loop = asyncio.get_running_loop()
        ratios_w, ratios_r = [], []
        for r in range(rounds):
            await evict_all()
            rw = await loop.run_in_executor(None, raw_write)
            tw = await tier_write(off, tier, keys, ids, job)
            rr = await loop.run_in_executor(None, raw_read)
            tr = await tier_read(off, tier, keys, ids, job)
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
    if not args.no_disk:
        await disk_sections(args, base)
    if args.mooncake != "off":
        await mooncake_section(args)


async def disk_sections(args: argparse.Namespace, base: Path) -> None:
    print("| block | round | raw write GB/s | tier write GB/s | write ratio | raw read GB/s "
          "| tier read GB/s | read ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    direct = False
    for kib in args.blocks:
        lines, direct = await throughput(
            base / f"t{kib}", kib << 10, args.mib << 20, args.rounds,
            max_io_bytes=args.max_io_bytes, read_threads=args.read_threads,
        )  # fmt: skip
        print("\n".join(lines))
    print(f"\nO_DIRECT: {direct}\n")
    print("| replay (working set 10x the CPU pool) | hit rate | requests/s |")
    print("|---|---|---|")
    for name, root in (("CPU pool alone", None), ("CPU pool + disk tier", base / "replay")):
        hit, rate = await replay(root, pool=args.pool, requests=args.requests, seed=0)
        print(f"| {name} | {hit:.1%} | {rate:.0f} |")


# -- Mooncake ------------------------------------------------------------------------


def mooncake_layout(block_bytes: int, gpu_blocks: int = 4) -> CanonicalKVCaches:
    """One canonical tensor (vLLM's cross-layer layout): a block is one buffer."""
    return CanonicalKVCaches.from_engine([torch.zeros(gpu_blocks, block_bytes, dtype=torch.int8)])


async def mooncake_throughput(
    settings: dict[str, object], block_bytes: int, total: int, rounds: int
) -> list[str]:
    from mooncake.store import MooncakeDistributedStore

    from aiokvo.tiers.mooncake import MooncakeTier

    n = total // block_bytes
    kv = mooncake_layout(block_bytes)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block, cpu_bytes_to_use=n * block_bytes,
    )  # fmt: skip
    # One Mooncake client for both: a second client in one process measured 1.6-2x slower
    # gets here, whichever made the calls. The raw calls borrow the tier's store (set up and
    # with the pool registered by the tier) through the tier's store_factory seam.
    stores: list[MooncakeDistributedStore] = []

    def shared_store() -> MooncakeDistributedStore:
        stores.append(MooncakeDistributedStore())
        return stores[-1]

    tier = MooncakeTier(
        model_id=f"bench-{block_bytes}", store_factory=shared_store, **settings  # type: ignore[arg-type]
    )
    lines = []
    job = [20_000_000]
    async with Offloader(config, kv, tiers=[tier]) as off:
        await off.open()
        assert tier.statistics().connected, "the Mooncake tier did not connect"
        (raw,) = stores
        (pool,) = off.spec.cpu_tensors  # type: ignore[attr-defined]
        pool.copy_(torch.randint(-128, 127, pool.shape, dtype=torch.int8))
        stride = pool.stride(0)  # rows may have room for the tier's trailer after them
        ptrs = [pool.data_ptr() + b * stride for b in range(n)]
        ids = CPULoadStoreSpec(np.arange(n))
        loop = asyncio.get_running_loop()

        def raw_call(call: object, names: list[str]) -> float:
            start = time.perf_counter()
            codes = call(names, ptrs, [block_bytes] * n)  # type: ignore[operator]
            elapsed = time.perf_counter() - start
            assert all(c >= 0 for c in codes), sorted(set(codes))
            return elapsed

        ratios_w, ratios_r = [], []
        for r in range(rounds + 1):  # round 0 warms the node's fresh segment memory
            keys = [make_offload_key(hashlib.sha256(b"mc%d-%d" % (r, i)).digest(), 0)
                    for i in range(n)]  # fmt: skip
            names = [f"bench-raw/{block_bytes}/{r}/{i}" for i in range(n)]
            rw = await loop.run_in_executor(None, raw_call, raw.batch_put_from, names)
            tw = await tier_write(off, tier, keys, ids, job)
            rr = await loop.run_in_executor(None, raw_call, raw.batch_get_into, names)
            tr = await tier_read(off, tier, keys, ids, job)
            raw.remove_all(True)  # room for the next round (the tier's objects too)
            if r == 0:
                continue
            gb = n * block_bytes / 1e9
            ratios_w.append(rw / tw)
            ratios_r.append(rr / tr)
            lines.append(
                f"| {block_bytes // 1024} KiB | {r} | {gb / rw:.2f} | {gb / tw:.2f} | "
                f"{rw / tw:.2f}x | {gb / rr:.2f} | {gb / tr:.2f} | {rr / tr:.2f}x |"
            )
        lines.append(
            f"| {block_bytes // 1024} KiB | median | | | "
            f"**{statistics.median(ratios_w):.2f}x** | | | "
            f"**{statistics.median(ratios_r):.2f}x** |"
        )
    return lines


def prefix_traces(
    replicas: int, *, prefixes: int, length: int, requests: int, seed: int
) -> list[list[list[bytes]]]:
    """Per replica, a request stream over one shared Zipf population of prefixes
    (each replica its own draw), plus two blocks of each request's own."""
    population = [[make_offload_key(hashlib.sha256(b"sp%d-%d" % (p, i)).digest(), 0)
                   for i in range(length)] for p in range(prefixes)]  # fmt: skip
    weights = [1 / (i + 1) ** 0.8 for i in range(prefixes)]
    traces = []
    for replica in range(replicas):
        rng = random.Random(seed + replica)
        stream = []
        for r in range(requests):
            own = [make_offload_key(hashlib.sha256(b"own%d-%d-%d" % (replica, r, i)).digest(), 0)
                   for i in range(2)]  # fmt: skip
            stream.append(rng.choices(population, weights)[0] + own)
        traces.append(stream)
    return traces


async def mooncake_sharing(
    settings: dict[str, object] | None, *, pool: int, requests: int, seed: int
) -> list[tuple[float, int]]:
    """Hit rate and Mooncake hits of each of two replicas replaying their traces."""
    from aiokvo.tiers.mooncake import MooncakeTier

    block = 64 << 10
    traces = prefix_traces(2, prefixes=4 * pool // 8, length=8, requests=requests, seed=seed)
    offloaders = []
    for _ in traces:
        kv = mooncake_layout(block, gpu_blocks=16)
        config = OffloadConfig(
            gpu_block_sizes=(16,), hash_block_size=16,
            kv_bytes_per_block=kv.page_bytes_per_block, cpu_bytes_to_use=pool * block,
        )  # fmt: skip
        tiers = [] if settings is None else [
            MooncakeTier(model_id="bench-sharing", key_prefix=f"bench-{seed}", **settings)  # type: ignore[arg-type]
        ]  # fmt: skip
        offloaders.append(Offloader(config, kv, tiers=tiers))
    try:
        for off in offloaders:
            await off.open()
        for step in range(requests):
            for off, trace in zip(offloaders, traces, strict=True):
                keys = trace[step]
                ids = list(range(len(keys)))
                await off.load_prefix(keys, ids)
                await off.store(keys, ids)
                await off.drain()  # the write-through lands before the other replica asks
        out = []
        for off in offloaders:
            snap = off.statistics()
            hit = snap.hit_blocks / (snap.hit_blocks + snap.miss_blocks)
            out.append((hit, snap.hits_by_medium.get("MOONCAKE", 0)))
        return out
    finally:
        for off in offloaders:
            await off.aclose()


async def mooncake_section(args: argparse.Namespace) -> None:
    from aiokvo.testing import LocalCluster

    cluster: LocalCluster | None = None
    if args.mooncake == "local":
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        cluster = LocalCluster(nodes=1, segment_size=args.mooncake_segment_mib << 20).start()
        settings: dict[str, object] = cluster.tier_settings()
        where = f"a loopback cluster (1 storage node, {args.mooncake_segment_mib} MiB)"
    else:
        settings = {"master_server_addr": args.mooncake, "metadata_server": "P2PHANDSHAKE"}
        where = f"the cluster at {args.mooncake}"
    try:
        print(f"\n## Mooncake, on {where}\n")
        print("| block | round | raw put GB/s | tier put GB/s | put ratio | raw get GB/s "
              "| tier get GB/s | get ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for kib in args.mooncake_blocks:
            for line in await mooncake_throughput(settings, kib << 10, args.mib << 20,
                                                  args.rounds):  # fmt: skip
                print(line)
        print("\n| two replicas, overlapping prefix traces | replica A hit rate "
              "| replica B hit rate | hits from Mooncake (A, B) |")  # fmt: skip
        print("|---|---|---|---|")
        runs = (("CPU pools alone", None), ("with the Mooncake tier", settings))
        for name, tier_settings in runs:
            (a, ma), (b, mb) = await mooncake_sharing(
                tier_settings, pool=args.pool, requests=args.requests, seed=1
            )
            print(f"| {name} | {a:.1%} | {b:.1%} | {ma}, {mb} |")
    finally:
        if cluster is not None:
            cluster.stop()


def _mooncake_default() -> str:
    import importlib.util

    return "local" if importlib.util.find_spec("mooncake") is not None else "off"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory on the disk to measure")
    p.add_argument("--mib", type=int, default=512, help="MiB written and read per pass")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 1024], help="KiB")
    p.add_argument("--pool", type=int, default=64, help="CPU pool blocks for the replay")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--no-disk", action="store_true", help="skip the disk sections")
    p.add_argument(
        "--max-io-bytes", type=int, default=DEFAULT_MAX_IO_BYTES,
        help="the disk tier's max_io_bytes (1: one system call per block, no coalescing)",
    )  # fmt: skip
    p.add_argument(
        "--read-threads", type=int, default=DEFAULT_READ_THREADS,
        help="the disk tier's read_threads (1: one read in flight)",
    )  # fmt: skip
    p.add_argument(
        "--mooncake", default=_mooncake_default(),
        help="'local' (start a loopback cluster), a master HOST:PORT, or 'off'",
    )  # fmt: skip
    p.add_argument("--mooncake-blocks", type=int, nargs="+", default=[512, 2048], help="KiB")
    p.add_argument("--mooncake-segment-mib", type=int, default=1024)
    aiokvo.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
