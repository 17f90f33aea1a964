"""vLLM 0.32 on aiokvo against vLLM's native offload, side by side in one run.

1. Scheduler side: vLLM's real Scheduler and OffloadingConnector drive the
   same seeded workload (shared prefixes, GPU-cache resets that force CPU
   loads, CPU-pool pressure) with vLLM's native spec (its
   CPUOffloadingManager; a CPU copy worker, since vLLM's refuses the CPU)
   and with aiokvo's spec. Reported: time per engine step spent inside the
   offloading manager (every manager call timed), rounds interleaved.
2. Worker side: the cost of one transfer through aiokvo's synchronous facade
   (a pumped loop, or a loop thread) against aiokvo's native async path
   (``await worker.transfer_async(...)`` in a running loop), same host
   handlers, same small transfers, rounds interleaved.

Run with the vLLM venv:  PYTHONPATH=. .vllm-venv/bin/python benchmarks/bench_vllm.py
(``make bench-vllm``). Ratios are what to read: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from tests.integrations.vllm.harness import (
    AIOKVO_SPEC,
    BLOCK,
    NATIVE_SPEC,
    VOCAB,
    Harness,
    Options,
    write_tiny_model,
)


# ------------------------------------------------------------- scheduler side
def workload(h: Harness, seed: int, requests: int) -> None:
    rng = np.random.default_rng(seed)
    docs = [[int(x) for x in rng.integers(10, VOCAB, size=6 * BLOCK)] for _ in range(12)]
    sent = 0
    while sent < requests:
        for _ in range(8):
            doc = docs[int(rng.integers(len(docs)))]
            cut = int(rng.integers(2, 7)) * BLOCK
            question = [int(x) for x in rng.integers(10, VOCAB, size=int(rng.integers(5, 40)))]
            h.add(doc[:cut] + question, max_tokens=int(rng.integers(2, 6)))
            sent += 1
        h.run_until_idle()
        if rng.random() < 0.5:
            h.sched.reset_prefix_cache()  # next batch must come from the CPU pool


def scheduler_side(model: Path, rounds: int, requests: int, policy: str) -> dict[str, Any]:
    per_step: dict[str, list[float]] = {"native": [], "aiokvo": []}
    per_call: dict[str, list[float]] = {"native": [], "aiokvo": []}
    calls: dict[str, int] = {}
    loads: dict[str, int] = {}
    for r in range(rounds):
        order = ["native", "aiokvo"] if r % 2 == 0 else ["aiokvo", "native"]
        for name in order:
            spec = NATIVE_SPEC if name == "native" else AIOKVO_SPEC
            h = Harness(Options(spec=dict(spec), policy=policy, cpu_chunks=64, gpu_blocks=64,
                                check_attended=False), model)
            workload(h, seed=r, requests=requests)
            per_step[name].append(h.manager_seconds / h.steps * 1e6)
            calls[name] = sum(h.calls.values())
            per_call[name].append(h.manager_seconds / calls[name] * 1e6)
            loads[name] = h.loads_checked
            h.close()
    native, ours = statistics.median(per_step["native"]), statistics.median(per_step["aiokvo"])
    return {"policy": policy, "native_us_per_step": native, "aiokvo_us_per_step": ours,
            "ratio": native / ours, "calls": calls, "loads": loads, "rounds": per_step,
            "per_call": {k: statistics.median(v) for k, v in per_call.items()}}


# ---------------------------------------------------------------- worker side
def worker_side(rounds: int, transfers: int) -> dict[str, float]:
    from aiokvo.handlers import OffloadingWorker, make_cpu_gpu_handlers
    from aiokvo.handlers.sync import SyncOffloadingWorker
    from aiokvo.layout import CanonicalKVCaches
    from aiokvo.runtime.pump import LoopThread, PumpedLoop
    from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

    layers = [torch.zeros(64, 2, 4, 16, 16, dtype=torch.float32) for _ in range(2)]  # 8 KiB pages
    caches = CanonicalKVCaches.from_engine(layers)

    def build() -> tuple[OffloadingWorker, Any]:
        handlers = make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=64)
        worker = OffloadingWorker()
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu)
        worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu)
        return worker, handlers

    def spec(i: int) -> Any:
        b = i % 32
        return GPULoadStoreSpec([b, b + 32], [2], [0]), CPULoadStoreSpec([b, b + 32])

    def native() -> float:
        async def main() -> float:
            worker, _ = build()
            async with worker:
                t0 = time.perf_counter()
                for i in range(transfers):
                    await worker.transfer_async(i, spec(i))
                return (time.perf_counter() - t0) / transfers
        return asyncio.run(main())

    def facade(kind: str, poll: bool) -> float:
        worker, _ = build()
        driver = PumpedLoop() if kind == "pump" else LoopThread()
        sync = SyncOffloadingWorker(worker, driver)
        t0 = time.perf_counter()
        for i in range(transfers):
            sync.submit(i, spec(i))
            if poll:  # vLLM's way: get_finished every step until it is there
                while not sync.get_finished():
                    pass
            else:
                sync.wait({i})
                sync.get_finished()
        elapsed = (time.perf_counter() - t0) / transfers
        sync.close()
        driver.close()
        return elapsed

    def idle_pump() -> float:
        pumped = PumpedLoop()
        n = 20_000
        t0 = time.perf_counter()
        for _ in range(n):
            pumped.poll()
        pumped.close()
        return (time.perf_counter() - t0) / n

    cases = {
        "native async (await transfer_async)": native,
        "facade, pumped, wait": lambda: facade("pump", False),
        "facade, pumped, poll get_finished": lambda: facade("pump", True),
        "facade, loop thread, wait": lambda: facade("thread", False),
        "idle pump": idle_pump,
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(rounds):
        names = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in names:
            samples[name].append(cases[name]() * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--transfers", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny_opt")
        for policy in ("lru", "arc"):
            res = scheduler_side(model, args.rounds, args.requests, policy)
            print(f"scheduler side, {policy}: manager time per engine step "
                  f"native {res['native_us_per_step']:.1f} us, aiokvo "
                  f"{res['aiokvo_us_per_step']:.1f} us -> native/aiokvo {res['ratio']:.2f}x; "
                  f"per call {res['per_call']['native']:.2f} vs {res['per_call']['aiokvo']:.2f} us "
                  f"(median of {args.rounds}; manager calls {res['calls']}, "
                  f"loads checked {res['loads']})")
    res = worker_side(args.rounds, args.transfers)
    base = res["native async (await transfer_async)"]
    print(f"worker side, one 2-block (16 KiB per layer x 2) transfer, median of {args.rounds}:")
    for name, us in res.items():
        ratio = "" if name == "idle pump" else f"  ({us / base:.2f}x native)"
        print(f"  {name:40s} {us:8.1f} us{ratio}")


if __name__ == "__main__":
    main()
