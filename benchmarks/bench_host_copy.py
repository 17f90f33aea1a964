"""Host-backend copy bandwidth against one contiguous torch copy of the same bytes.

Each transfer moves ``--blocks`` scattered blocks of ``--layers`` layers x
(K, V) between CPU-resident "GPU" KV caches and the CPU pool, through the
public path (``transfer_async`` + ``await``: planning, worker thread, poller).
The reference is a single ``dst.copy_(src)`` of the same total byte count
(torch, all intra-op threads), timed in the same run, interleaved with the
handler, so the ratio holds even on a noisy machine; ``memcpy`` is the same
copy by numpy on one thread, and ``copy-only`` the handler's own copy time
(``TransferResult.transfer_time``, both directions), both for context.

Run: ``.venv/bin/python benchmarks/bench_host_copy.py`` (``--quick`` for a smoke
run; ``bench_async.py --quick`` runs it that way).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from aiokvo.handlers import make_cpu_gpu_handlers
from aiokvo.handlers.host import DEFAULT_COPY_THREADS
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.run import run
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", type=int, nargs="+", default=[4, 16, 32, 64])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per transfer")
    parser.add_argument("--layers", type=int, default=16, help="layers (each has K and V)")
    parser.add_argument("--pool-blocks", type=int, default=160, help="blocks per tensor")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--copy-threads", type=int, default=DEFAULT_COPY_THREADS)
    parser.add_argument("--poller-mode", default=None, choices=["spin", "adaptive", "thread"])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: pages of 4 and 32 KiB, 4 layers, 3 reps")
    args = parser.parse_args(argv)
    if args.quick:
        args.page_kib, args.layers, args.reps = [4, 32], 4, 3
    return args


async def _bench_page(page: int, args: argparse.Namespace) -> dict[str, float]:
    layers = [
        torch.randint(-128, 127, (2, args.pool_blocks, page), dtype=torch.int8)
        for _ in range(args.layers)
    ]
    caches = CanonicalKVCaches.from_engine(layers, layout="kv_first")
    total = args.blocks * len(caches.tensors) * page
    src = torch.randint(-128, 127, (total,), dtype=torch.int8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    rng = np.random.default_rng(page)
    src_np, dst_np = src.numpy(), dst.numpy()
    times: dict[str, list[float]] = {"contiguous": [], "memcpy": [], "store": [], "load": []}
    async with make_cpu_gpu_handlers(
        caches,
        block_size_factor=1,
        num_cpu_blocks=args.pool_blocks,
        poller_mode=args.poller_mode,
        copy_threads=args.copy_threads,
    ) as handlers:
        for cpu in handlers.cpu_tensors:
            cpu.fill_(1)  # fault the pool in
        jobs = iter(range(1, 1_000_000))
        copy_times: list[float] = []  # worker-side copy time, both directions

        async def store() -> None:
            spec = _random_pair(rng, args, gpu_first=True)
            result = await handlers.gpu_to_cpu.transfer_async(next(jobs), spec)
            assert result.success and result.transfer_size == total, result
            copy_times.append(result.transfer_time or 0.0)

        async def load() -> None:
            spec = _random_pair(rng, args, gpu_first=False)
            result = await handlers.cpu_to_gpu.transfer_async(next(jobs), spec)
            assert result.success and result.transfer_size == total, result
            copy_times.append(result.transfer_time or 0.0)

        async def memcpy() -> None:
            np.copyto(dst_np, src_np)

        async def contiguous() -> None:
            dst.copy_(src)

        ops = {"memcpy": memcpy, "contiguous": contiguous, "store": store, "load": load}
        order = random.Random(page)
        for rep in range(args.reps + 1):
            # Shuffle the order so no candidate always runs right after another
            # (torch's idle OpenMP threads spin for a while after a parallel copy).
            names = list(ops)
            order.shuffle(names)
            for name in names:
                start = time.perf_counter()
                await ops[name]()
                if rep:  # the first round warms threads and caches
                    times[name].append(time.perf_counter() - start)
    gbps = {name: total / statistics.median(ts) / 1e9 for name, ts in times.items()}
    gbps["copy"] = total / statistics.median(copy_times[2:]) / 1e9
    return gbps


def _random_pair(
    rng: np.random.Generator, args: argparse.Namespace, *, gpu_first: bool
) -> TransferSpec:
    gpu_ids = rng.choice(args.pool_blocks, size=args.blocks, replace=False)
    cpu_ids = rng.choice(args.pool_blocks, size=args.blocks, replace=False)
    gpu = GPULoadStoreSpec(gpu_ids, [args.blocks], [0])
    cpu = CPULoadStoreSpec(cpu_ids)
    return (gpu, cpu) if gpu_first else (cpu, gpu)


async def _main(args: argparse.Namespace) -> int:
    print(
        f"host copy: {args.blocks} scattered blocks x {args.layers} layers x (K, V) per "
        f"transfer, median of {args.reps}; copy_threads={args.copy_threads}, "
        f"poller_mode={args.poller_mode or 'default'}, "
        f"torch threads={torch.get_num_threads()}"
    )
    header = f"{'page':>7} {'MiB/xfer':>8} {'memcpy':>7} {'contig GB/s':>11} {'store GB/s':>10} "
    header += f"{'load GB/s':>9} {'store/contig':>12} {'load/contig':>11} {'copy-only':>9}"
    print(header)
    for kib in args.page_kib:
        page = kib * 1024
        gbps = await _bench_page(page, args)
        mib = args.blocks * args.layers * 2 * page / 2**20
        c = gbps["contiguous"]
        print(
            f"{kib:>5}Ki {mib:>8.0f} {gbps['memcpy']:>7.2f} {c:>11.2f} {gbps['store']:>10.2f} "
            f"{gbps['load']:>9.2f} {gbps['store'] / c:>12.0%} {gbps['load'] / c:>11.0%} "
            f"{gbps['copy']:>9.2f}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(_main(_parse(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
