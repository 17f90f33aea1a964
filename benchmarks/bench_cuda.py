"""CUDA backend throughput and latency, each engine next to its ceiling in the same run.

Measures, for GPU->CPU and CPU->GPU:

* a page-size sweep (4, 8, 16, 32, 64, 256, 512 KiB, 1, 2 MiB; pages in shuffled
  order on both sides, so nothing coalesces);
* a Llama-3-8B-like batch: 32 layers with K and V as separate tensors,
  16-token blocks of 8 heads x 128 x bf16 (32 KiB pages), 64 blocks per
  transfer;

each with the DMA engine, the SM copy kernel, a naive per-page torch
``copy_(non_blocking=True)`` loop, and the ceiling: one contiguous pinned
``cudaMemcpyAsync`` of the same total bytes. Ratios divide by the ceiling
measured seconds before, in the same process. Also measures the latency
from a completed CUDA event to the resumed coroutine, per poller mode.

``--fake`` runs the same code on the CPU with the fake driver (memmove, no
GPU); its numbers only prove the code path works and are labelled so.

Writes ``bench_cuda.md`` (tables) and ``bench_cuda.json`` (raw) to
``--out`` (default ``$OUT``, else ``./out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiokvo.device.driver import CudaDriver, RuntimeDriver, load_driver
from aiokvo.device.fake import FakeDriver
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler
from aiokvo.handlers.cuda.handles import CudaEvent
from aiokvo.layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from aiokvo.memory.pinned import PinnedHostTensor
from aiokvo.runtime.poller import EventPoller
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

KIB = 1024
SWEEP_PAGES = [4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 256 * KIB, 512 * KIB, 1024 * KIB,
               2048 * KIB]


@dataclass
class Row:
    case: str
    direction: str
    page_bytes: int
    copies: int
    total_bytes: int
    method: str
    device_s: float  # median device (or, with --fake, wall) time of the copy itself
    wall_s: float  # median submit-to-resumed-coroutine time (handlers) or = device_s
    gbps: float
    ceiling_gbps: float
    ratio: float
    submit_s: float = 0.0  # median host time inside transfer_async (plan + enqueue)


class Bench:
    def __init__(self, driver: CudaDriver, *, fake: bool, iters: int) -> None:
        self.driver = driver
        self.fake = fake
        self.iters = iters
        self.device = "cpu" if fake else "cuda"
        self.rows: list[Row] = []

    # ------------------------------------------------------------ primitives
    def timed_on_stream(self, enqueue: Callable[[int], None]) -> float:
        """Seconds for ``enqueue(stream)``'s work, median of ``iters`` after a warm-up."""
        drv = self.driver
        stream = drv.stream_create()
        start, stop = drv.event_create(timing=True), drv.event_create(timing=True)
        samples = []
        try:
            for i in range(self.iters + 1):
                t0 = time.perf_counter()
                drv.event_record(start, stream)
                enqueue(stream)
                drv.event_record(stop, stream)
                drv.event_synchronize(stop)
                wall = time.perf_counter() - t0
                if i:
                    samples.append(wall if self.fake else drv.event_elapsed_ms(start, stop) * 1e-3)
        finally:
            drv.event_destroy(start)
            drv.event_destroy(stop)
            drv.stream_destroy(stream)
        return statistics.median(samples)

    def ceiling(self, total: int, gpu_to_cpu: bool) -> float:
        """One contiguous pinned cudaMemcpyAsync of ``total`` bytes."""
        gpu = torch.empty(total, dtype=torch.int8, device=self.device)
        with PinnedHostTensor(1, total, driver=self.driver) as host:
            src, dst = (gpu, host.tensor) if gpu_to_cpu else (host.tensor, gpu)
            seconds = self.timed_on_stream(
                lambda s: self.driver.memcpy_async(dst.data_ptr(), src.data_ptr(), total, s)
            )
        del gpu
        return seconds

    def torch_loop(
        self,
        gpu: list[torch.Tensor],
        cpu: list[torch.Tensor],
        pairs: list[tuple[int, int]],
        gpu_to_cpu: bool,
    ) -> float:
        """Naive: one ``copy_(non_blocking=True)`` per page and tensor."""
        samples = []
        for i in range(self.iters + 1):
            if self.fake:
                t0 = time.perf_counter()
                self._torch_copies(gpu, cpu, pairs, gpu_to_cpu)
                seconds = time.perf_counter() - t0
            else:
                stream = torch.cuda.Stream()
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record()
                    self._torch_copies(gpu, cpu, pairs, gpu_to_cpu)
                    stop.record()
                stop.synchronize()
                seconds = start.elapsed_time(stop) * 1e-3
            if i:
                samples.append(seconds)
        return statistics.median(samples)

    @staticmethod
    def _torch_copies(
        gpu: list[torch.Tensor], cpu: list[torch.Tensor], pairs: list[tuple[int, int]], out: bool
    ) -> None:
        for g, c in pairs:
            for gt, ct in zip(gpu, cpu, strict=True):
                if out:
                    ct[c].copy_(gt[g], non_blocking=True)
                else:
                    gt[g].copy_(ct[c], non_blocking=True)

    async def handler_run(
        self,
        handler: CudaOffloadingHandler,
        make_spec: Callable[[], Any],
    ) -> tuple[float, float, float]:
        device, wall, submit = [], [], []
        for i in range(self.iters + 1):
            spec = make_spec()
            t0 = time.perf_counter()
            task = handler.transfer_async(i, spec)
            t1 = time.perf_counter()
            result = await task
            elapsed = time.perf_counter() - t0
            if not result.success:
                raise RuntimeError(f"{handler!r} transfer failed: {result.error}")
            if i:
                wall.append(elapsed)
                submit.append(t1 - t0)
                device.append(elapsed if self.fake else float(result.transfer_time or elapsed))
        return statistics.median(device), statistics.median(wall), statistics.median(submit)

    # ----------------------------------------------------------------- cases
    async def case(
        self,
        name: str,
        page: int,
        num_tensors: int,
        blocks_per_transfer: int,
        pool_blocks: int,
    ) -> None:
        gen = np.random.default_rng(0)
        gpu = [
            torch.randint(-128, 127, (pool_blocks, page), dtype=torch.int8, device=self.device)
            for _ in range(num_tensors)
        ]
        pins = [PinnedHostTensor(pool_blocks, page, driver=self.driver) for _ in range(num_tensors)]
        cpu = [p.tensor for p in pins]
        refs = [[CanonicalKVCacheRef(t, page) for t in range(num_tensors)]]
        gpu_ids = gen.permutation(pool_blocks)[:blocks_per_transfer]
        cpu_ids = gen.permutation(pool_blocks)[:blocks_per_transfer]
        pairs = list(zip(gpu_ids.tolist(), cpu_ids.tolist(), strict=True))
        total = page * num_tensors * blocks_per_transfer
        copies = num_tensors * blocks_per_transfer
        try:
            for gpu_to_cpu in (True, False):
                direction = "GPU->CPU" if gpu_to_cpu else "CPU->GPU"
                ceiling_s = self.ceiling(total, gpu_to_cpu)
                ceiling_gbps = total / ceiling_s / 1e9
                self._add(name, direction, page, copies, total, "ceiling", ceiling_s,
                          ceiling_s, ceiling_gbps)

                def make_spec(out: bool = gpu_to_cpu) -> Any:
                    gpu_spec = GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0])
                    cpu_spec = CPULoadStoreSpec(cpu_ids)
                    return (gpu_spec, cpu_spec) if out else (cpu_spec, gpu_spec)

                for engine in ("dma", "kernel"):
                    kv = CanonicalKVCaches(
                        [CanonicalKVCacheTensor(t, int(t.shape[1])) for t in gpu], refs
                    )
                    handler = CudaOffloadingHandler(
                        kv, cpu, block_size_factor=1, gpu_to_cpu=gpu_to_cpu, driver=self.driver,
                        engine=engine, max_buffered=0,
                    )
                    async with handler:
                        device_s, wall_s, submit_s = await self.handler_run(handler, make_spec)
                    self._add(name, direction, page, copies, total, engine, device_s, wall_s,
                              ceiling_gbps, submit_s)
                loop_s = self.torch_loop(gpu, cpu, pairs, gpu_to_cpu)
                self._add(name, direction, page, copies, total, "torch copy_ loop", loop_s,
                          loop_s, ceiling_gbps)
        finally:
            for p in pins:
                p.close()

    def _add(self, case: str, direction: str, page: int, copies: int, total: int, method: str,
             device_s: float, wall_s: float, ceiling_gbps: float, submit_s: float = 0.0) -> None:
        gbps = total / device_s / 1e9
        row = Row(case, direction, page, copies, total, method, device_s, wall_s, gbps,
                  ceiling_gbps, gbps / ceiling_gbps, submit_s)
        self.rows.append(row)
        print(f"  {case:>10} {direction} {method:>16}: {gbps:7.2f} GB/s "
              f"({row.ratio:5.1%} of ceiling), wall {total / wall_s / 1e9:7.2f} GB/s", flush=True)

    # --------------------------------------------------------------- latency
    async def latency(self, trials: int) -> dict[str, dict[str, float]]:
        """Completed CUDA event -> resumed coroutine, per poller mode.

        A reference event is recorded on an idle stream at host time t0;
        the watched event ends a short copy. ``t0 + elapsed(ref, end)`` is
        when the end event completed on the host clock (late by the
        reference record's own latency, so this over-estimates slightly).
        """
        drv = self.driver
        loop = asyncio.get_running_loop()
        poller = EventPoller.for_loop(loop)
        stream = drv.stream_create()
        ref, end = drv.event_create(timing=True), drv.event_create(timing=True)
        nbytes = 4 << 20
        gpu = torch.empty(nbytes, dtype=torch.int8, device=self.device)
        out: dict[str, dict[str, float]] = {}
        try:
            with PinnedHostTensor(1, nbytes, driver=drv) as host:
                for mode in ("thread", "adaptive", "spin"):
                    samples = []
                    for _ in range(trials):
                        drv.stream_synchronize(stream)
                        t0 = time.perf_counter()
                        drv.event_record(ref, stream)
                        drv.memcpy_async(host.tensor.data_ptr(), gpu.data_ptr(), nbytes, stream)
                        drv.event_record(end, stream)
                        await poller.watch(("bench-latency", mode), CudaEvent(drv, end), mode=mode)
                        resumed = time.perf_counter()
                        if self.fake:
                            continue
                        done = t0 + drv.event_elapsed_ms(ref, end) * 1e-3
                        samples.append((resumed - done) * 1e6)
                    if samples:
                        samples.sort()
                        out[mode] = {
                            "p50_us": samples[len(samples) // 2],
                            "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
                            "trials": float(len(samples)),
                        }
                        print(f"  latency {mode:>8}: p50 {out[mode]['p50_us']:.1f} us, "
                              f"p99 {out[mode]['p99_us']:.1f} us", flush=True)
        finally:
            drv.event_destroy(ref)
            drv.event_destroy(end)
            drv.stream_destroy(stream)
        return out


def markdown(rows: list[Row], latency: dict[str, dict[str, float]], meta: dict[str, Any]) -> str:
    lines = [f"# bench_cuda ({'FAKE: CPU memmove, not GPU numbers' if meta['fake'] else 'GPU'})",
             "", f"- command: `{meta['command']}`", f"- device: {meta['device']}",
             f"- host: {meta['host']}", f"- date: {meta['date']}",
             f"- cudaMemcpyBatchAsync: {meta['batch']}", "",
             "| case | direction | page | copies | method | GB/s | % ceiling | wall GB/s "
             "| submit ms |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        page = f"{r.page_bytes // KIB} KiB"
        lines.append(
            f"| {r.case} | {r.direction} | {page} | {r.copies} | {r.method} | {r.gbps:.2f} | "
            f"{r.ratio:.0%} | {r.total_bytes / r.wall_s / 1e9:.2f} | "
            f"{r.submit_s * 1e3:.2f} |"
        )
    if latency:
        lines += ["", "| poller mode | event->coroutine p50 (us) | p99 (us) |", "|---|---:|---:|"]
        for mode, stats in latency.items():
            lines.append(f"| {mode} | {stats['p50_us']:.1f} | {stats['p99_us']:.1f} |")
    timing = ("host wall time of memmoves on fake streams (FAKE: says nothing about GPUs)"
              if meta["fake"] else "CUDA timing events around the copies (device time)")
    lines += ["", f"GB/s: {timing}; wall GB/s: submit to resumed coroutine; submit ms: host "
              "time inside transfer_async (planning and enqueueing; the timing start event is "
              "recorded before the copies are enqueued, so a slow enqueue also lowers GB/s). "
              "Ceiling: one contiguous pinned cudaMemcpyAsync of the same bytes, measured in "
              "the same run."]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    driver: CudaDriver
    if args.fake:
        driver = FakeDriver()
        device = "FakeDriver (CPU threads + memmove)"
        batch = "fake"
    else:
        real = load_driver(0)
        driver = real
        device = f"{torch.cuda.get_device_name(0)} sm_{real.device_arch()}"
        batch = f"{real.has_memcpy_batch()} (driver {real.driver_version}, runtime " \
                f"{real.runtime_version})"
    bench = Bench(driver, fake=args.fake, iters=args.iters)
    total = args.total_mib << 20
    pages = SWEEP_PAGES if not args.fake else SWEEP_PAGES[:3] + SWEEP_PAGES[-1:]
    print(f"device: {device}; batch: {batch}", flush=True)
    for page in pages:
        blocks = max(4, total // page)
        await bench.case("sweep", page, 1, blocks, pool_blocks=blocks)
    layers = 32 if not args.fake else 4
    await bench.case("llama3-8b", 32 * KIB, 2 * layers, 64, pool_blocks=args.llama_pool_blocks)
    latency = await bench.latency(args.latency_trials)
    meta = {
        "fake": args.fake,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device,
        "batch": batch,
        "host": f"{platform.node()} nproc={os.cpu_count()} {platform.processor()}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
    }
    out = Path(args.out or os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cuda.json").write_text(
        json.dumps({"meta": meta, "rows": [asdict(r) for r in bench.rows], "latency": latency},
                   indent=2)
    )
    table = markdown(bench.rows, latency, meta)
    (out / "bench_cuda.md").write_text(table)
    print(table)
    if isinstance(driver, FakeDriver):
        driver.close()
    elif isinstance(driver, RuntimeDriver):
        torch.cuda.synchronize()
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fake", action="store_true", help="CPU fake driver (code-path check)")
    parser.add_argument("--out", help="output folder (default $OUT, else ./out)")
    parser.add_argument("--iters", type=int, default=None, help="timed repeats per point")
    parser.add_argument("--total-mib", type=int, default=None, help="bytes per sweep transfer")
    parser.add_argument("--llama-pool-blocks", type=int, default=None)
    parser.add_argument("--latency-trials", type=int, default=None)
    args = parser.parse_args(argv)
    defaults = (
        {"iters": 2, "total_mib": 2, "llama_pool_blocks": 96, "latency_trials": 20}
        if args.fake
        else {"iters": 10, "total_mib": 64, "llama_pool_blocks": 256, "latency_trials": 300}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import uvloop

        return uvloop.run(main_async(args))
    except ImportError:
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
