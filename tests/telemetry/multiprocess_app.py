"""A process in prometheus-client's multiprocess mode, for test_multiprocess.py.

``python -m tests.telemetry.multiprocess_app engine|front HITS`` (with
``PROMETHEUS_MULTIPROC_DIR`` set) runs an Offloader whose load hits ``HITS``
blocks, increments an ordinary multiprocess ``Counter``, serves metrics on an
ephemeral port, prints the port, and waits for stdin to close:

* ``engine`` serves its own aiokvo metrics (one metrics server per process);
* ``front`` serves a ``MultiProcessCollector`` registry (every process's
  ordinary metrics) with its own ``OffloadMetrics`` registered beside it.
"""

from __future__ import annotations

import asyncio
import os
import sys

from prometheus_client import CollectorRegistry, Counter, multiprocess

from aiokvo import Offloader
from aiokvo.telemetry.prometheus import OffloadMetrics, start_metrics_server
from tests.offloader._harness import KV, keys


async def main(role: str, hits: int) -> None:
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR"), "multiprocess mode is off"
    Counter("app_requests", "an ordinary metric", ["role"]).labels(role).inc(hits)
    kv = KV(64)
    async with Offloader(kv.config(16), kv.caches) as off:
        ks = keys(*(f"{role}{i}" for i in range(hits)))
        assert (await off.store(ks, list(range(hits)))).ok
        assert await off.load_prefix([*ks, *keys("miss")], list(range(20, 21 + hits))) == hits
        if role == "front":
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            server = start_metrics_server(OffloadMetrics(off, registry), 0)
        else:
            server = start_metrics_server(off, 0)
        async with server:
            print(server.port, flush=True)
            await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin
        if role == "front":
            await server.metrics.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
