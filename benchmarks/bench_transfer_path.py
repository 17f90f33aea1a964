"""The per-transfer path: aiokvo against a plain executor hop, and the vLLM facade.

Every engine step pays for a few small transfers, so what one costs beyond
its copy matters. Three ways to run the same 2-block copy (2 tensors, 8 KiB
pages, from a 64-block "GPU" cache into a 64-block CPU pool), each awaited
before the next:

* ``executor hop``: the same copy without aiokvo's machinery, as a
  competent engineer would write it: the block ids as index arrays, each
  tensor viewed as one ``np.void`` element per page (the copy aiokvo's host
  backend makes), and ``await loop.run_in_executor(pool, copy)`` on a
  one-thread ``ThreadPoolExecutor``. (torch's indexing was slower for these
  rows: ``benchmarks/results_host.md``.)
* ``aiokvo native``: ``await worker.transfer_async(job_id, spec)`` through
  aiokvo's host handlers (validation, planning, the dispatch thread, the
  poller).
* ``aiokvo facade``: ``SyncOffloadingWorker`` on a pumped private loop, as
  vLLM's worker drives it: ``submit`` then ``get_finished`` until the result
  is there (the loop only runs inside those calls).

Rounds alternate the order; medians of per-round means are reported, and
ratios of paired (same-round) values, of wall time and of this process's
CPU time: on an oversubscribed machine a one-thread path (an inline copy)
gets a smaller share of the cores than a two-thread one, so its wall time
says more about the machine's load than about the path. Targets (issue 21): native <= 1.2x the
executor hop, facade <= 1.3x native.

    .venv/bin/python benchmarks/bench_transfer_path.py [--rounds 9] [--transfers 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from aiokvo.handlers import OffloadingWorker, make_cpu_gpu_handlers
from aiokvo.handlers.sync import SyncOffloadingWorker
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.pump import PumpedLoop
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

BLOCKS = 64
LAYERS = [torch.zeros(BLOCKS, 2, 4, 16, 16, dtype=torch.float32) for _ in range(2)]  # 8 KiB


def spec(i: int) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    b = i % 32
    return GPULoadStoreSpec([b, b + 32], [2], [0]), CPULoadStoreSpec([b, b + 32])


def build(**options: Any) -> OffloadingWorker:
    caches = CanonicalKVCaches.from_engine(LAYERS)
    handlers = make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=BLOCKS,
                                     **options)
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu)
    return worker


def _pages(t: torch.Tensor) -> np.ndarray:
    rows = t.reshape(t.shape[0], -1).view(torch.int8).numpy()
    return rows.view(np.dtype((np.void, rows.shape[1]))).reshape(rows.shape[0])


def executor_hop(n: int) -> float:
    gpu = [_pages(t) for t in LAYERS]
    cpu = [np.zeros_like(p) for p in gpu]

    def copy(src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        for s, d in zip(gpu, cpu, strict=True):
            d[dst_ids] = s[src_ids]

    async def main() -> float:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            for i in range(n):
                src, dst = spec(i)
                src_ids = np.asarray(src.block_ids, dtype=np.int64)
                dst_ids = np.asarray(dst.block_ids, dtype=np.int64)
                await loop.run_in_executor(pool, copy, src_ids, dst_ids)
            return (time.perf_counter() - t0) / n

    return asyncio.run(main())


def native(n: int, **options: Any) -> float:
    async def main() -> float:
        worker = build(**options)
        async with worker:
            t0 = time.perf_counter()
            for i in range(n):
                await worker.transfer_async(i, spec(i))
            return (time.perf_counter() - t0) / n

    return asyncio.run(main())


def facade(n: int, **options: Any) -> float:
    driver = PumpedLoop()
    sync = SyncOffloadingWorker(build(**options), driver)
    t0 = time.perf_counter()
    for i in range(n):
        sync.submit(i, spec(i))
        while not sync.get_finished():  # vLLM's way: poll every step until it is there
            pass
    elapsed = (time.perf_counter() - t0) / n
    sync.close()
    driver.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--transfers", type=int, default=2000)
    args = ap.parse_args()
    cases: dict[str, Callable[[int], float]] = {
        "executor hop": executor_hop,
        "aiokvo native": native,
        "aiokvo facade": facade,
        # The copy always on the dispatch thread (inline_below_bytes=0): the hand-off
        # the default skips for small transfers.
        "native, thread copy": partial(native, inline_below_bytes=0),
        "facade, thread copy": partial(facade, inline_below_bytes=0),
    }
    for fn in cases.values():  # warm-up: imports, first threads, caches
        fn(200)
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        names = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in names:
            c0 = time.process_time()
            wall[name].append(cases[name](args.transfers) * 1e6)
            cpu[name].append((time.process_time() - c0) / args.transfers * 1e6)

    def paired(samples: dict[str, list[float]], a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))

    load = os.getloadavg()[0]
    print(f"one 2-block transfer (2 x 8 KiB pages x 2 tensors), {args.transfers} per round, "
          f"median of {args.rounds} rounds; load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"  {'':22s} {'wall us':>9s} {'CPU us':>9s}   (CPU: this process, all threads)")
    for name in cases:
        print(f"  {name:22s} {statistics.median(wall[name]):9.1f} "
              f"{statistics.median(cpu[name]):9.1f}")
    result: dict[str, Any] = {"load": load}
    for label, a, b, target in (
        ("native / executor hop", "aiokvo native", "executor hop", 1.2),
        ("facade / native", "aiokvo facade", "aiokvo native", 1.3),
        ("thread copy: native / hop", "native, thread copy", "executor hop", 1.2),
        ("thread copy: facade / native", "facade, thread copy", "native, thread copy", 1.3),
    ):
        w, c = paired(wall, a, b), paired(cpu, a, b)
        result[label] = {"wall": round(w, 3), "cpu": round(c, 3)}
        print(f"  {label:30s} wall {w:.2f}x  CPU {c:.2f}x  (target <= {target}x)")


if __name__ == "__main__":
    main()
