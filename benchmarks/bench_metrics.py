"""What aiokvo's Prometheus metrics cost the scheduler, measured side by side.

Three numbers, each from one run:

* the result path: ``ResultQueue.put`` with no tap and with one tap (what
  ``worker.tap_results()`` adds to every finished transfer);
* the Offloader with and without an ``OffloadMetrics`` (its stream task and
  tap running, scraped over HTTP every ``--scrape-interval`` seconds from a
  thread, as Prometheus would): ``bench_offloader.py``'s request stream,
  one coroutine, rounds interleaved, the loop thread's CPU time per request
  and its ratio (best of the rounds: interference only adds time);
* one scrape: the loop's share (the snapshot) and the whole text.

Run: ``python benchmarks/bench_metrics.py`` (``--quick`` for a short run).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import timeit
import urllib.request
from collections.abc import Sequence

from bench_offloader import (  # this folder is on sys.path when run as a script
    HANDLER_OPTIONS,
    SHAPES,
    config_for,
    gpu_slots,
    machine,
    make_stream,
    run,
)
from prometheus_client import CollectorRegistry, generate_latest

from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, OffloadKey
from aiokvo.handlers.task import ResultQueue
from aiokvo.specs import TransferResult
from aiokvo.telemetry.prometheus import OffloadMetrics, start_metrics_server


def bench_put(number: int) -> tuple[float, float]:
    result = TransferResult(job_id=1, success=True, transfer_size=4096, transfer_time=1e-4,
                            transfer_type=("GPU", "CPU"))
    bare, tapped = ResultQueue(0), ResultQueue(0)
    tap = tapped.tap(number * 5 + 1)
    times = {}
    for name, queue in (("bare", bare), ("tapped", tapped)):
        times[name] = min(timeit.repeat(lambda q=queue: q.put(result), number=number, repeat=5))
    tap.close()
    return times["bare"] / number, times["tapped"] / number


async def drive(
    kv: CanonicalKVCaches, config: OffloadConfig, stream: list[list[OffloadKey]],
    scrape_interval: float | None,
) -> tuple[float, float, int]:
    """CPU seconds of the loop's thread, wall seconds, scrapes (None: no metrics)."""
    slots = gpu_slots(kv)
    async with Offloader(config, kv, handler_options=HANDLER_OPTIONS) as off:
        server = None if scrape_interval is None else start_metrics_server(off, 0)
        stop = threading.Event()
        scrapes = 0

        def scraper() -> None:
            nonlocal scrapes
            assert server is not None and scrape_interval is not None
            while not stop.wait(scrape_interval):
                with urllib.request.urlopen(server.url, timeout=30) as response:
                    response.read()
                scrapes += 1

        thread = threading.Thread(target=scraper) if server is not None else None
        if thread is not None:
            thread.start()
        started, cpu = time.perf_counter(), time.thread_time()
        for turn, keys in enumerate(stream):
            gpu_ids = slots[turn % len(slots)][: len(keys)]
            await off.load_prefix(keys, gpu_ids)
            await off.store(keys, gpu_ids)
        seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
        stop.set()
        if thread is not None:
            await asyncio.to_thread(thread.join)
        if server is not None:
            await server.aclose()
    return cpu, seconds, scrapes


async def scrape_cost(kv: CanonicalKVCaches, config: OffloadConfig,
                      stream: list[list[OffloadKey]]) -> tuple[float, float]:
    slots = gpu_slots(kv)
    async with Offloader(config, kv) as off:
        for turn, keys in enumerate(stream):
            gpu_ids = slots[turn % len(slots)][: len(keys)]
            await off.load_prefix(keys, gpu_ids)
            await off.store(keys, gpu_ids)
        async with OffloadMetrics(off, CollectorRegistry()) as metrics:
            n = 500
            snapshot = min(timeit.repeat(metrics._take, number=n, repeat=3)) / n
            whole = min(timeit.repeat(lambda: generate_latest(metrics.registry),
                                      number=50, repeat=3)) / 50
    return snapshot, whole


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scrape-interval", type=float, default=0.1,
                        help="seconds between scrapes (Prometheus: 15; 0.1 exaggerates)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8KiB")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 500, 2
    print(machine())
    bare, tapped = bench_put(200_000 if not args.quick else 20_000)
    print(f"ResultQueue.put: {bare * 1e9:.0f} ns bare, {tapped * 1e9:.0f} ns with a tap "
          f"(+{(tapped - bare) * 1e9:.0f} ns per transfer result)")

    shape = SHAPES[args.shape]
    kv = shape.caches(16 * 4)
    config = config_for(kv, 1024)
    stream = make_stream(args.requests, 64, seed=0)
    best: dict[str, float] = {}
    ratios = []
    scrapes = 0
    for _ in range(args.rounds):
        off_cpu, _, _ = run(drive, kv, config, stream, None)  # type: ignore[arg-type]
        on_cpu, _, n = run(drive, kv, config, stream, args.scrape_interval)  # type: ignore[arg-type]
        scrapes += n
        ratios.append(on_cpu / off_cpu)
        best["off"] = min(best.get("off", off_cpu), off_cpu)
        best["on"] = min(best.get("on", on_cpu), on_cpu)
    per = 1e6 / args.requests
    print(f"{shape.name}, {args.requests} requests x {args.rounds} rounds, one coroutine; "
          f"metrics on: scraped every {args.scrape_interval} s ({scrapes} scrapes in all)")
    print(f"  loop CPU per request: off {best['off'] * per:.2f} us, on {best['on'] * per:.2f} us, "
          f"ratio {best['on'] / best['off']:.3f} (paired rounds {min(ratios):.3f}-"
          f"{max(ratios):.3f})")
    snapshot, whole = run(scrape_cost, kv, config, stream[:1000])  # type: ignore[arg-type]
    print(f"one scrape: {snapshot * 1e6:.0f} us on the loop (the snapshot), "
          f"{whole * 1e6:.0f} us in all (with the text)")


if __name__ == "__main__":
    main()
