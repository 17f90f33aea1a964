"""The tiers against what a competent engineer would write with the same library.

Run:  .venv/bin/python benchmarks/bench_tiers.py [--dir DIR] [--mib 512] [--rounds 11]
                                                 [--max-io-bytes N] [--read-threads N] [--no-disk]
                                                 [--mooncake local|HOST:PORT|off]

Every table is measured side by side in one run: each round runs every
variant once, in an order rotated from round to round, after one unmeasured
round (allocation, caches, the cluster's fresh memory); a ratio is the median
of the rounds' paired ratios (its interquartile range beside it), a GB/s the
median of the rounds. The baselines are ``benchmarks/_tier_baselines.py``.

1. **Disk, side by side in one directory.** For each block size the same
   CPU-pool rows are written and read back three ways: *bare* (``os.pwritev``
   / ``os.preadv`` with the tier's call sizes and queue depth: adjacent blocks
   in calls of up to ``max_io_bytes``, one write at a time in order, reads in
   ``read_threads`` shares at once; O_DIRECT when the tier uses it; a file
   preallocated and overwritten in place, as the tier overwrites its slots),
   *raw + xxh3* (the same, each block's xxh3-64 computed on a helper thread
   while it is written, and verified by each reading thread while the other's
   call is in flight: the competent raw), and the disk tier's ``(CPU, DISK)``
   / ``(DISK, CPU)`` transfers through the worker, ``prepare_*`` and
   ``complete_*`` included (checksums, index entries, outcomes). The target
   is tier / raw + xxh3; the floor beside it, raw + xxh3 / bare, is what any
   check costs.
2. **Warm page-cache reads**: the same three reads of data the page cache
   holds (a buffered tier, ``direct_io=False``, and a buffered raw file, each
   read once before the rounds).
3. **Replay.** A Zipf prefix-reuse stream whose working set is 10x the CPU
   pool, served by an Offloader with the CPU pool alone, then with a disk
   tier below it: hit rate and requests/s.
4. **Mooncake, side by side on one cluster** (``--mooncake local``, the
   default when Mooncake is installed, starts a loopback ``LocalCluster``: one
   storage-node process; ``HOST:PORT`` uses a running master with P2P
   metadata). One canonical tensor, so a block is one row and its trailer one
   buffer with it. On the tier's own client (a second client in one process
   measured 1.6-2x slower gets), fresh objects each round: *bare*
   ``batch_put_from`` / ``batch_get_into`` of each row and its room (the
   tier's object size), *by hand* (the xxh3 of every row on
   ``checksum_threads`` threads kept in its room, then the put; the get, then
   the same verification pass), and the tier. The target is tier / by hand;
   the floor, by hand / bare, is what the check costs (for a get: raw /
   (raw + verify pass)).
5. **Mooncake, keyed** (``integrity_key``): the keyed tier against the same
   tier with its keyed check off (one tier on one client, switched between
   rounds: the plain xxh3 trailer) and against *GMAC by hand* (the same
   AES-GMAC from ``cryptography`` over each block's identity and row, then the
   put; the get, then the check).
6. **Cross-instance hits.** Two engine replicas (two Offloaders, each with its
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
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch
from _tier_baselines import RawDisk, RawMooncake

import aiokvo
from aiokvo import CanonicalKVCaches, CPULoadStoreSpec, OffloadConfig, Offloader, make_offload_key
from aiokvo.keys import OffloadKey
from aiokvo.tiers import DiskTier, Tier
from aiokvo.tiers.disk.format import SlabGeometry
from aiokvo.tiers.disk.runs import DEFAULT_MAX_IO_BYTES, DEFAULT_READ_THREADS

TENSORS = 2  # K and V: two iovecs per block on disk

Timed = Callable[[], Awaitable[float]]
"""One variant's run: the seconds it took."""


def layout(block_bytes: int, gpu_blocks: int = 4) -> CanonicalKVCaches:
    page = block_bytes // TENSORS
    return CanonicalKVCaches.from_engine(
        [torch.zeros(gpu_blocks, page, dtype=torch.int8) for _ in range(TENSORS)]
    )


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


async def in_thread(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes on an executor thread, seen from the loop (as a transfer is)."""
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    await loop.run_in_executor(None, fn)
    return time.perf_counter() - start


async def paired_rounds(
    rounds: int, phases: list[dict[str, Timed]], after: Callable[[], Awaitable[None]] | None = None
) -> list[dict[str, list[float]]]:
    """Seconds of every variant of every phase per round, after one unmeasured round;
    each phase's variants run in an order rotated from round to round."""
    times: list[dict[str, list[float]]] = [{name: [] for name in phase} for phase in phases]
    for r in range(rounds + 1):
        for phase, out in zip(phases, times, strict=True):
            names = list(phase)
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                elapsed = await phase[name]()
                if r:
                    out[name].append(elapsed)
        if after is not None:
            await after()
    return times


def ratio(times: dict[str, list[float]], of: str, to: str) -> str:
    """Median (and IQR) of the per-round throughput ratio ``of`` / ``to``."""
    paired = [b / a for a, b in zip(times[of], times[to], strict=True)]
    median = statistics.median(paired)
    if len(paired) < 4:
        return f"{median:.2f}x"
    q1, _, q3 = statistics.quantiles(paired, n=4)
    return f"{median:.2f}x ({q1:.2f}-{q3:.2f})"


def gbps(nbytes: int, seconds: list[float]) -> str:
    return f"{nbytes / statistics.median(seconds) / 1e9:.2f}"


def keys_of(tag: bytes, n: int) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(b"%s-%d" % (tag, i)).digest(), 0) for i in range(n)]


async def tier_write(off: Offloader, tier: Tier, keys: list[OffloadKey], ids: CPULoadStoreSpec,
                     job: list[int]) -> float:  # fmt: skip
    """Seconds one (CPU, tier) transfer of every key from the pool rows ``ids`` takes,
    the tier's ``prepare_store`` and ``complete_store`` included."""
    start = time.perf_counter()
    store = tier.prepare_store(keys)
    assert store is not None and len(store.keys) == len(keys)
    job[0] += 1
    result = await off.worker.transfer_async(job[0], (ids, store.spec))
    tier.complete_store(store, result)
    elapsed = time.perf_counter() - start
    assert result.success, result
    return elapsed


async def tier_read(off: Offloader, tier: Tier, keys: list[OffloadKey], ids: CPULoadStoreSpec,
                    job: list[int]) -> float:  # fmt: skip
    """Seconds one (tier, CPU) transfer of every key into the pool rows ``ids`` takes,
    ``prepare_load`` and ``complete_load`` included; every block must come back good."""
    start = time.perf_counter()
    load = tier.prepare_load(keys)
    assert load is not None
    job[0] += 1
    result = await off.worker.transfer_async(job[0], (load.spec, ids))
    good = tier.complete_load(load, result)
    elapsed = time.perf_counter() - start
    assert len(good) == len(keys) and result.success, result
    return elapsed


# -- Disk ----------------------------------------------------------------------------


def slab_capacity(n: int, slot_bytes: int) -> int:
    """capacity_bytes of a slab of exactly ``n`` slots: each round's fresh keys evict
    the last round's and overwrite their slots, as the raw file is overwritten."""
    return SlabGeometry(b"\0" * 32, slot_bytes, n).index_bytes + n * slot_bytes


def disk_config(block_bytes: int, n: int) -> tuple[CanonicalKVCaches, OffloadConfig]:
    kv = layout(block_bytes)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block, cpu_bytes_to_use=n * block_bytes,
    )  # fmt: skip
    return kv, config


async def disk_throughput(
    root: Path, block_bytes: int, total: int, rounds: int, *, max_io_bytes: int,
    read_threads: int,
) -> tuple[list[str], bool]:  # fmt: skip
    """Table rows (write, read) of one block size, and whether O_DIRECT was used."""
    n = total // block_bytes
    kv, config = disk_config(block_bytes, n)
    tier = DiskTier(
        root, capacity_bytes=slab_capacity(n, block_bytes), model_id=f"bench-{block_bytes}",
        refresh_interval=0, max_io_bytes=max_io_bytes, read_threads=read_threads,
    )  # fmt: skip
    async with Offloader(config, kv, tiers=[tier]) as off:
        pool = off.spec.cpu_tensors  # type: ignore[attr-defined]
        for t in pool:
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8))
        stats = tier.statistics()
        assert stats.slot_bytes == block_bytes, stats.slot_bytes
        direct = stats.direct_io
        rows = [[t.numpy()[b] for t in pool] for b in range(n)]
        raw = RawDisk(tier.store.directory.parent / f"raw-{block_bytes}.dat", rows, block_bytes,
                      direct=direct, max_io_bytes=max_io_bytes,
                      read_threads=read_threads)  # fmt: skip
        try:
            await in_thread(raw.preallocate)
            ids = CPULoadStoreSpec(np.arange(n))
            job, written = [10_000_000], [0]
            keys: list[list[OffloadKey]] = [keys_of(b"w0", n)]
            await tier_write(off, tier, keys[0], ids, job)  # the slab's slots allocated

            async def tier_writes() -> float:
                written[0] += 1
                keys[0] = keys_of(b"w%d" % written[0], n)  # evicts the last round's
                return await tier_write(off, tier, keys[0], ids, job)

            def raw_read(checksum: bool) -> None:
                assert raw.read(checksum=checksum) == 0, "raw read back a wrong block"

            before = load()
            writes, reads = await paired_rounds(rounds, [
                {"bare": lambda: in_thread(lambda: raw.write(checksum=False)),
                 "raw": lambda: in_thread(lambda: raw.write(checksum=True)),
                 "tier": tier_writes},
                {"bare": lambda: in_thread(lambda: raw_read(False)),
                 "raw": lambda: in_thread(lambda: raw_read(True)),
                 "tier": lambda: tier_read(off, tier, keys[0], ids, job)},
            ])  # fmt: skip
        finally:
            raw.close()
            os.unlink(tier.store.directory.parent / f"raw-{block_bytes}.dat")
    nbytes = n * block_bytes
    lines = [
        f"| {block_bytes >> 10} KiB | {op} | {rounds} | {gbps(nbytes, t['bare'])} | "
        f"{gbps(nbytes, t['raw'])} | {gbps(nbytes, t['tier'])} | "
        f"**{ratio(t, 'tier', 'raw')}** | {ratio(t, 'raw', 'bare')} | "
        f"{ratio(t, 'tier', 'bare')} | {before} → {load()} |"
        for op, t in (("write", writes), ("read", reads))
    ]
    return lines, direct


async def warm_reads(root: Path, block_bytes: int, total: int, rounds: int, *,
                     max_io_bytes: int, read_threads: int) -> str:  # fmt: skip
    """One table row: reads of data the page cache holds, tier and raw both buffered."""
    n = total // block_bytes
    kv, config = disk_config(block_bytes, n)
    tier = DiskTier(
        root, capacity_bytes=slab_capacity(n, block_bytes), model_id=f"bench-warm-{block_bytes}",
        refresh_interval=0, max_io_bytes=max_io_bytes, read_threads=read_threads,
        direct_io=False,
    )  # fmt: skip
    async with Offloader(config, kv, tiers=[tier]) as off:
        pool = off.spec.cpu_tensors  # type: ignore[attr-defined]
        for t in pool:
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8))
        assert not tier.statistics().direct_io
        rows = [[t.numpy()[b] for t in pool] for b in range(n)]
        path = tier.store.directory.parent / f"raw-warm-{block_bytes}.dat"
        raw = RawDisk(path, rows, block_bytes, direct=False, max_io_bytes=max_io_bytes,
                      read_threads=read_threads)  # fmt: skip
        try:
            ids = CPULoadStoreSpec(np.arange(n))
            job = [30_000_000]
            keys = keys_of(b"warm", n)
            await in_thread(raw.preallocate)
            await tier_write(off, tier, keys, ids, job)
            await in_thread(os.sync)  # no writeback under the reads

            def raw_read(checksum: bool) -> None:
                assert raw.read(checksum=checksum) == 0, "raw read back a wrong block"

            before = load()
            (reads,) = await paired_rounds(rounds, [
                {"bare": lambda: in_thread(lambda: raw_read(False)),
                 "raw": lambda: in_thread(lambda: raw_read(True)),
                 "tier": lambda: tier_read(off, tier, keys, ids, job)},
            ])  # fmt: skip
        finally:
            raw.close()
            os.unlink(path)
    t = reads
    return (
        f"| {block_bytes >> 10} KiB | warm read | {rounds} | {gbps(n * block_bytes, t['bare'])} | "
        f"{gbps(n * block_bytes, t['raw'])} | {gbps(n * block_bytes, t['tier'])} | "
        f"**{ratio(t, 'tier', 'raw')}** | {ratio(t, 'raw', 'bare')} | "
        f"{ratio(t, 'tier', 'bare')} | {before} → {load()} |"
    )


async def replay(
    root: Path | None, *, pool: int, requests: int, seed: int
) -> tuple[float, float, dict[str, object]]:
    """Hit rate, requests/s and what explains them (see ``replay_figures``)."""
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
        elapsed = 0.0
        peak_pinned = 0
        for keys in stream:
            ids = list(range(len(keys)))
            start = time.perf_counter()
            await off.load_prefix(keys, ids)
            await off.store(keys, ids)
            elapsed += time.perf_counter() - start
            # Between requests nothing but tier writes in flight pins pool blocks: their
            # peak is the pool a slow tier took away (sampled outside the timing).
            peak_pinned = max(peak_pinned, off.statistics().manager.pinned_blocks)
        snap = off.statistics()
    hit = snap.hit_blocks / (snap.hit_blocks + snap.miss_blocks)
    return hit, requests / elapsed, replay_figures(snap, peak_pinned)


def replay_figures(snap: aiokvo.OffloaderStatistics, peak_pinned: int) -> dict[str, object]:
    """The figures that explain a replay's hit rate: the pool's own share of the hits
    (a tier's writes in flight pin pool blocks, so a slow tier can cut it below the pool
    alone), and what kept the tier out (writes skipped at the write limit, timeouts,
    failures, the breaker)."""
    asked = snap.hit_blocks + snap.miss_blocks
    figures: dict[str, object] = {
        "pool hits": f"{snap.hits_by_medium.get('CPU', 0) / asked:.1%}",
        "peak pool blocks pinned": peak_pinned,
        "stores refused": snap.stores_refused,
        "promotion timeouts": snap.promotion_timeouts,
        "promotions no room": snap.promotions_no_room,
        "writes skipped": snap.tier_writes_skipped,
    }
    for t in snap.tiers:
        figures[f"{t.medium} hits"] = f"{snap.hits_by_medium.get(t.medium, 0) / asked:.1%}"
        figures[f"{t.medium} blocks written"] = t.blocks_written
        figures[f"{t.medium} write/read failures"] = f"{t.write_failures}/{t.read_failures}"
        figures[f"{t.medium} timeouts"] = t.timeouts
        figures[f"{t.medium} lookups bypassed"] = t.lookups_bypassed
        figures[f"{t.medium} breaker"] = f"{t.breaker.state}, {t.breaker.trips} trips"
        figures[f"{t.medium} failure causes"] = dict(t.failure_causes) or "-"
    return figures


async def main_async(args: argparse.Namespace) -> None:
    made = args.dir is None
    base = Path(tempfile.mkdtemp(prefix="aiokvo-bench-")) if made else Path(args.dir)
    base.mkdir(mode=0o700, exist_ok=True)
    try:
        await run_sections(args, base)
    finally:  # the sections' files are gigabytes: never leave them behind
        if made:
            shutil.rmtree(base, ignore_errors=True)


async def run_sections(args: argparse.Namespace, base: Path) -> None:
    print(f"# bench_tiers: {args.mib} MiB per pass, {args.rounds} rounds, in {base}")
    print(f"# {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
          f"{os.cpu_count()} CPUs, load average {load()} (1/5 min)\n")  # fmt: skip
    if not args.no_disk:
        await disk_sections(args, base)
    if args.mooncake != "off":
        await mooncake_section(args)


async def disk_sections(args: argparse.Namespace, base: Path) -> None:
    print(f"## Disk: {args.mib} MiB per pass, {args.rounds} rounds, in {base}\n")
    print("| block | op | rounds | bare GB/s | raw + xxh3 GB/s | tier GB/s | tier / raw + xxh3 "
          "| floor: raw + xxh3 / bare | tier / bare | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    direct = False
    knobs = {"max_io_bytes": args.max_io_bytes, "read_threads": args.read_threads}
    for kib in args.blocks:
        try:
            lines, direct = await disk_throughput(base / f"t{kib}", kib << 10, args.mib << 20,
                                                  args.rounds, **knobs)  # fmt: skip
        finally:
            shutil.rmtree(base / f"t{kib}", ignore_errors=True)
        print("\n".join(lines), flush=True)
    if not args.no_warm:
        for kib in args.blocks:
            try:
                line = await warm_reads(base / f"w{kib}", kib << 10, args.mib << 20,
                                        args.rounds, **knobs)  # fmt: skip
            finally:
                shutil.rmtree(base / f"w{kib}", ignore_errors=True)
            print(line, flush=True)
    print(f"\nO_DIRECT (cold rows): {direct}\n")
    print("| replay (working set 10x the CPU pool) | hit rate | requests/s |")
    print("|---|---|---|")
    explained = []
    for name, root in (("CPU pool alone", None), ("CPU pool + disk tier", base / "replay")):
        try:
            hit, rate, figures = await replay(root, pool=args.pool, requests=args.requests, seed=0)
        finally:
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
        print(f"| {name} | {hit:.1%} | {rate:.0f} |")
        explained.append((name, figures))
    # A run off its usual figures (a tier below the pool alone) says why right here.
    print(f"\nreplay figures (load {load()}):")
    for name, figures in explained:
        print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


# -- Mooncake ------------------------------------------------------------------------


def mooncake_layout(block_bytes: int, gpu_blocks: int = 4) -> CanonicalKVCaches:
    """One canonical tensor (vLLM's cross-layer layout): a block is one buffer."""
    return CanonicalKVCaches.from_engine([torch.zeros(gpu_blocks, block_bytes, dtype=torch.int8)])


async def mooncake_throughput(
    settings: dict[str, object], block_bytes: int, total: int, rounds: int, *, keyed: bool
) -> list[str]:
    """Table rows (put, get) of one block size: the plain tier against bare calls and the
    check by hand, or (``keyed``) the keyed tier against itself unkeyed and GMAC by hand."""
    from mooncake.store import MooncakeDistributedStore

    from aiokvo.tiers.mooncake import MooncakeTier

    n = total // block_bytes
    kv = mooncake_layout(block_bytes)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block, cpu_bytes_to_use=n * block_bytes,
    )  # fmt: skip
    # One Mooncake client for all: a second client in one process measured 1.6-2x slower
    # gets here, whichever made the calls. The raw calls borrow the tier's store (set up and
    # with the pool registered by the tier) through the tier's store_factory seam.
    stores: list[MooncakeDistributedStore] = []

    def shared_store() -> MooncakeDistributedStore:
        stores.append(MooncakeDistributedStore())
        return stores[-1]

    key = secrets.token_bytes(32)
    tier = MooncakeTier(
        model_id=f"bench-{block_bytes}", store_factory=shared_store,
        integrity_key=key.hex() if keyed else None, **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    job = [20_000_000]
    async with Offloader(config, kv, tiers=[tier]) as off:
        await off.open()
        assert tier.statistics().connected, "the Mooncake tier did not connect"
        (store,) = stores
        (pool,) = off.spec.cpu_tensors  # type: ignore[attr-defined]
        pool.copy_(torch.randint(-128, 127, pool.shape, dtype=torch.int8))
        threads = tier.store.config.checksum_threads
        raw = RawMooncake(store, pool, block_bytes, threads=threads, key=key)
        ids = CPULoadStoreSpec(np.arange(n))
        loop = asyncio.get_running_loop()
        rounds_done = [0]
        keyed_check = tier.store._keyed  # switched off for the "unkeyed" variant's rounds

        def names(what: str) -> list[str]:
            return [f"bench-raw/{block_bytes}/{what}/{rounds_done[0]}/{i}" for i in range(n)]

        def tier_keys(what: bytes) -> list[OffloadKey]:
            return keys_of(b"mc-%s-%d" % (what, rounds_done[0]), n)

        async def tier_put(check: object, what: bytes) -> float:
            tier.store._keyed = check
            try:
                return await tier_write(off, tier, tier_keys(what), ids, job)
            finally:
                tier.store._keyed = keyed_check

        async def tier_get(check: object, what: bytes) -> float:
            tier.store._keyed = check
            try:
                return await tier_read(off, tier, tier_keys(what), ids, job)
            finally:
                tier.store._keyed = keyed_check

        def checked(fn: Callable[[list[str]], int], what: str) -> Callable[[], None]:
            def run() -> None:
                assert fn(names(what)) == 0, "a block read by hand failed its check"

            return run

        async def next_round() -> None:
            await loop.run_in_executor(None, store.remove_all, True)  # room for the next
            rounds_done[0] += 1

        before = load()
        if not keyed:
            puts, gets = await paired_rounds(rounds, [
                {"bare": lambda: in_thread(lambda: raw.put(names("bare"))),
                 "hand": lambda: in_thread(lambda: raw.hash_then_put(names("hand"))),
                 "tier": lambda: tier_put(None, b"t")},
                {"bare": lambda: in_thread(lambda: raw.get(names("bare"))),
                 "hand": lambda: in_thread(checked(raw.get_then_verify, "hand")),
                 "tier": lambda: tier_get(None, b"t")},
            ], next_round)  # fmt: skip
        else:
            puts, gets = await paired_rounds(rounds, [
                {"bare": lambda: in_thread(lambda: raw.put(names("bare"))),
                 "hand": lambda: in_thread(lambda: raw.mac_then_put(names("mac"))),
                 "plain": lambda: tier_put(None, b"p"),
                 "tier": lambda: tier_put(keyed_check, b"k")},
                {"bare": lambda: in_thread(lambda: raw.get(names("bare"))),
                 "hand": lambda: in_thread(checked(raw.get_then_check_mac, "mac")),
                 "plain": lambda: tier_get(None, b"p"),
                 "tier": lambda: tier_get(keyed_check, b"k")},
            ], next_round)  # fmt: skip
        raw.close()
    nbytes = n * block_bytes
    lines = []
    for op, t in (("put", puts), ("get", gets)):
        row = (
            f"| {block_bytes >> 10} KiB | {op} | {rounds} | {gbps(nbytes, t['bare'])} | "
            f"{gbps(nbytes, t['hand'])} | "
        )
        if keyed:
            row += f"{gbps(nbytes, t['plain'])} | {gbps(nbytes, t['tier'])} | " \
                   f"**{ratio(t, 'tier', 'hand')}** | {ratio(t, 'hand', 'bare')} | " \
                   f"{ratio(t, 'tier', 'plain')} | {before} → {load()} |"
        else:
            row += f"{gbps(nbytes, t['tier'])} | **{ratio(t, 'tier', 'hand')}** | " \
                   f"{ratio(t, 'hand', 'bare')} | {ratio(t, 'tier', 'bare')} | " \
                   f"{before} → {load()} |"
        lines.append(row)
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

    mib = args.mooncake_mib or min(args.mib, 256)
    cluster: LocalCluster | None = None
    if args.mooncake == "local":
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        # Room for the four sets of objects of a keyed round under the eviction watermark.
        segment = args.mooncake_segment_mib or 4 * mib * 5 // 4 + 64
        cluster = LocalCluster(nodes=1, segment_size=segment << 20).start()
        settings: dict[str, object] = cluster.tier_settings()
        where = f"a loopback cluster (1 storage node, {segment} MiB)"
    else:
        settings = {"master_server_addr": args.mooncake, "metadata_server": "P2PHANDSHAKE"}
        where = f"the cluster at {args.mooncake}"
    try:
        print(f"\n## Mooncake, on {where}: {mib} MiB per pass, {args.rounds} rounds\n")
        print("| block | op | rounds | bare GB/s | by hand GB/s | tier GB/s "
              "| tier / by hand | floor: by hand / bare | tier / bare | load |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for kib in args.mooncake_blocks:
            for line in await mooncake_throughput(settings, kib << 10, mib << 20, args.rounds,
                                                  keyed=False):  # fmt: skip
                print(line, flush=True)
        if not args.no_keyed:
            print("\n| block | op | rounds | bare GB/s | GMAC by hand GB/s | unkeyed tier GB/s "
                  "| keyed tier GB/s | keyed / GMAC by hand | floor: GMAC by hand / bare "
                  "| keyed / unkeyed | load |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for kib in args.mooncake_blocks:
                for line in await mooncake_throughput(settings, kib << 10, mib << 20,
                                                      args.rounds, keyed=True):  # fmt: skip
                    print(line, flush=True)
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
    p.add_argument("--rounds", type=int, default=11,
                   help="measured rounds per table (after one unmeasured)")  # fmt: skip
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 1024], help="KiB")
    p.add_argument("--pool", type=int, default=64, help="CPU pool blocks for the replays")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--no-disk", action="store_true", help="skip the disk sections")
    p.add_argument("--no-warm", action="store_true", help="skip the warm page-cache reads")
    p.add_argument(
        "--max-io-bytes", type=int, default=DEFAULT_MAX_IO_BYTES,
        help="the disk tier's (and raw's) max_io_bytes (1: one system call per block)",
    )  # fmt: skip
    p.add_argument(
        "--read-threads", type=int, default=DEFAULT_READ_THREADS,
        help="the disk tier's (and raw's) read_threads (1: one read in flight)",
    )  # fmt: skip
    p.add_argument(
        "--mooncake", default=_mooncake_default(),
        help="'local' (start a loopback cluster), a master HOST:PORT, or 'off'",
    )  # fmt: skip
    p.add_argument("--mooncake-blocks", type=int, nargs="+", default=[512, 2048], help="KiB")
    p.add_argument("--mooncake-mib", type=int, default=None,
                   help="MiB per pass in the Mooncake sections (default: --mib, at most 256)")
    p.add_argument("--mooncake-segment-mib", type=int, default=None,
                   help="the local cluster's segment (default: room for a keyed round)")
    p.add_argument("--no-keyed", action="store_true", help="skip the keyed Mooncake table")
    aiokvo.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
