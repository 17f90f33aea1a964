"""Completion latency while the event loop is busy running Python.

A scheduler's loop is rarely idle: it runs Python in millisecond slices and
yields between them. A completion that must be delivered by *another* Python
thread (a host copy's dispatch thread, or a ``thread``-mode waiter parked in
``synchronize()``) then needs the GIL from a loop thread that keeps releasing
and immediately re-taking it at every ``select(0)``. CPython's GIL only forces
a hand-off when a waiter saw no switch for a whole switch interval (5 ms), and
each of the loop's own release/re-take counts as a switch, so the waiter can
starve for seconds (the "convoy effect"). aiokvo works around it: the loop
polls pending lanes itself (1 ms in ``thread`` mode), a started host copy
marks itself done without needing the GIL back, and a host copy its thread
has not started after ``inline_after`` runs on the loop (docs/async.md).

    python benchmarks/bench_busy_loop.py [--busy-ms 1.0] [--n 20]

Prints p50/max delivery latency per poller mode, with the loop idle and busy,
for (a) a source that completes with no Python (a CUDA event's case) and
(b) a 64 MiB transfer through the real host handler (its copy runs on a
Python thread). No thresholds: it reports the delay, the table in
benchmarks/RESULTS.md has the before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import torch
from bench_async import DeadlineSource  # this folder is on sys.path when run as a script

from aiokvo.handlers import make_cpu_gpu_handlers
from aiokvo.layout import CanonicalKVCaches
from aiokvo.runtime.poller import EventPoller, PollerMode
from aiokvo.runtime.run import run
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

MODES: tuple[PollerMode, ...] = ("spin", "adaptive", "thread")


async def _with_busy_loop(
    busy_ms: float, body: Callable[[], Awaitable[list[float]]]
) -> list[float]:
    stop = False

    async def busy() -> None:
        while not stop:
            start = time.perf_counter()
            while time.perf_counter() - start < busy_ms / 1000:
                pass
            await asyncio.sleep(0)

    task = asyncio.create_task(busy()) if busy_ms > 0 else None
    try:
        return await body()
    finally:
        stop = True
        if task is not None:
            await task


async def device_latencies(mode: PollerMode, n: int, busy_ms: float) -> list[float]:
    poller = EventPoller.current()

    async def body() -> list[float]:
        out = []
        for _ in range(n):
            source = DeadlineSource(time.perf_counter() + 0.002)
            await poller.watch(("busy-bench", mode), source, mode=mode)
            out.append(time.perf_counter() - source.deadline)
        return out

    return await _with_busy_loop(busy_ms, body)


async def host_latencies(mode: PollerMode, n: int, busy_ms: float) -> list[float]:
    layers = [torch.zeros(128, 32 * 1024, dtype=torch.int8) for _ in range(16)]
    kv = CanonicalKVCaches.from_engine(layers)
    pair = make_cpu_gpu_handlers(kv, block_size_factor=1, num_cpu_blocks=128, poller_mode=mode)
    gpu = GPULoadStoreSpec(list(range(64)), [64], [0])
    cpu = CPULoadStoreSpec(list(range(64)))

    async def body() -> list[float]:
        out = []
        for job in range(n):
            start = time.perf_counter()
            result = await pair.gpu_to_cpu.transfer_async(job, (gpu, cpu))
            assert result.success
            out.append(time.perf_counter() - start - (result.transfer_time or 0.0))
        return out

    try:
        return await _with_busy_loop(busy_ms, body)
    finally:
        await pair.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-ms", type=float, default=1.0, help="Python slice between yields")
    parser.add_argument("--n", type=int, default=20, help="completions per row")
    args = parser.parse_args()
    print("| completion | mode | loop | p50 ms | max ms |")
    print("|---|---|---|---:|---:|")
    for name, measure in (("device-style", device_latencies), ("host copy 32 MiB", host_latencies)):
        for mode in MODES:
            for busy in (0.0, args.busy_ms):
                lat = run(measure(mode, args.n, busy))
                label = "idle" if busy == 0 else f"busy {busy:g} ms"
                print(
                    f"| {name} | {mode} | {label} | {statistics.median(lat) * 1e3:.2f} "
                    f"| {max(lat) * 1e3:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
