"""Live offload telemetry: an Offloader's metrics, served over HTTP and summed per second.

Run:  python examples/telemetry.py [--seconds 3] [--port 9400]

The workload is a stream of "requests" of 8 blocks drawn from three times
more distinct blocks than the CPU pool holds: each looks up its prefix
(``load_prefix``) and stores what was missing (``store``), so the pool stays
full and evicts. Meanwhile:

* ``start_metrics_server(off, port)`` serves aiokvo's Prometheus metrics
  (point Prometheus at the printed URL, or run ``aiokvo watch --metrics URL``
  in another terminal for a live view);
* once a second this prints one line per tier from the package's own
  aggregation (``aiokvo.telemetry.stats``: ``rates`` between two totals,
  ``format_lines``), the same lines ``aiokvo watch`` prints when piped;
* at the end it scrapes its own endpoint once, reads the text back
  (``totals_from_text``) and checks it against ``off.statistics()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Sequence

import numpy as np
import torch

from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, make_offload_key
from aiokvo.runtime.run import run
from aiokvo.telemetry.prometheus import MetricsServer, start_metrics_server, totals_from_text
from aiokvo.telemetry.stats import Totals, format_lines, rates


async def _workload(off: Offloader, seconds: float, pool_blocks: int) -> None:
    rng = np.random.default_rng(0)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        ids = rng.choice(3 * pool_blocks, size=8, replace=False)
        keys = [make_offload_key(int(i).to_bytes(16, "big"), 0) for i in ids]
        gpu = [int(b) for b in rng.choice(128, size=8, replace=False)]
        hits = await off.load_prefix(keys, gpu)
        await off.store(keys[hits:], gpu[hits:])
        await asyncio.sleep(0)  # let the metrics server's scrapes and the reporter in


async def _report(server: MetricsServer, start: Totals) -> None:
    """One line per tier per second, from the package's aggregation."""
    last = start
    while True:
        await asyncio.sleep(1.0)
        now = server.metrics.totals()
        for line in format_lines(rates(last, now)):
            print(line, flush=True)
        last = now


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


async def _demo(seconds: float, pool_blocks: int, port: int) -> int:
    layers = [torch.zeros(2, 128, 16, 8, 64, dtype=torch.bfloat16) for _ in range(4)]
    kv = CanonicalKVCaches.from_engine(layers, layout="kv_first")
    config = OffloadConfig(
        gpu_block_sizes=(16,),
        hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block,
        cpu_bytes_to_use=pool_blocks * kv.page_bytes_per_block,
    )
    async with Offloader(config, kv) as off, start_metrics_server(off, port) as server:
        print(f"metrics at {server.url}  (live view: aiokvo watch --metrics {server.url})")
        start = server.metrics.totals()
        reporter = asyncio.create_task(_report(server, start))
        try:
            await _workload(off, seconds, pool_blocks)
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        text = await asyncio.to_thread(_scrape, server.url)  # the loop answers the scrape
        stats = off.statistics()
    scraped = totals_from_text(text)
    cpu = scraped.tiers["CPU"]
    final = format_lines(rates(start, scraped))[0]  # rates: the run's average
    print(f"final: {final}")
    store, load = scraped.transfer("store", "CPU"), scraped.transfer("load", "CPU")
    print(f"copy bandwidth: store {store.bytes / store.seconds / 1e9 if store.seconds else 0:.2f}"
          f" GB/s, load {load.bytes / load.seconds / 1e9 if load.seconds else 0:.2f} GB/s")
    expected = (stats.hit_blocks, stats.manager.blocks_stored, stats.manager.blocks_evicted,
                stats.store_bytes, stats.load_bytes)
    got = (cpu.hit_blocks, cpu.stored_blocks, cpu.evicted_blocks, store.bytes, load.bytes)
    if got != expected:
        print(f"MISMATCH: scraped {got}, statistics() {expected}")
        return 1
    print("scraped metrics match statistics()")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--port", type=int, default=0, help="metrics port (0: any free one)")
    args = parser.parse_args(argv)
    return run(_demo(args.seconds, args.pool_blocks, args.port))


if __name__ == "__main__":
    raise SystemExit(main())
