"""The Mooncake tier against real clusters: a master and storage-node processes.

Each test starts its own throwaway cluster on loopback (the plugin's
``mooncake_cluster`` fixture) and stops it by pid. Without Mooncake the
tests skip naming what is missing; on CI they fail instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiokvo.testing import LocalCluster
from aiokvo.testing.mooncake import ClusterFactory
from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.mooncake import MooncakeTier
from tests.offloader._harness import KV, keys
from tests.tiers.mooncake._support import PagesKV, eventually, mooncake_stats, replica

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("aiokvo_leak_check")]

ROOT = Path(__file__).resolve().parents[3]
GUARD = 60.0  # seconds: a hang guard, not a timing expectation


def tier_on(cluster: LocalCluster, **settings: Any) -> StoreTier:
    options: dict[str, Any] = {"model_id": "test-model", **cluster.tier_settings()}
    options.update(settings)
    address = options.pop("master_server_addr")
    return MooncakeTier(address, model_id=options.pop("model_id"), **options)


async def test_blocks_stored_by_a_replica_in_another_process_are_loaded_byte_exact(
    mooncake_cluster: ClusterFactory,
) -> None:
    cluster = mooncake_cluster(1, segment_size=64 << 20)
    names = [f"shared/{i}" for i in range(12)]
    env = {**os.environ, **cluster.client_env, "MC_LOG_LEVEL": "ERROR"}
    child = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tests.tiers.mooncake._replica",
         "--master", cluster.master_server_addr, "--metadata", cluster.metadata_server, *names],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=GUARD,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    written = json.loads(child.stdout.strip().splitlines()[-1])
    assert written["blocks_written"] == 12 and written["write_failures"] == 0
    kv = KV(64)
    async with replica(tier_on(cluster), kv) as b:
        ks = keys(*names)
        gpu = list(range(20, 32))
        assert await asyncio.wait_for(b.load_prefix(ks, gpu), GUARD) == 12
        assert kv.holds(gpu, ks)
        assert b.statistics().hits_by_medium["MOONCAKE"] == 12
        stats = mooncake_stats(b)
        assert (stats.blocks_read, stats.read_failures, stats.remote_lookups) == (12, 0, 1)


async def test_a_killed_storage_node_is_misses_never_wrong_bytes_and_the_rest_serves(
    mooncake_cluster: ClusterFactory,
) -> None:
    cluster = mooncake_cluster(2, segment_size=32 << 20, client_ttl=10)
    first, second = cluster.nodes
    on_first, on_second = keys(*[f"n0/{i}" for i in range(6)]), keys(*[f"n1/{i}" for i in range(6)])
    for node, ks in ((first, on_first), (second, on_second)):
        kv = KV(64)
        async with replica(tier_on(cluster, preferred_segment=node.name), kv) as writer:
            kv.write(list(range(6)), ks)
            await writer.store(ks, list(range(6)))
            await writer.drain()
            assert mooncake_stats(writer).blocks_written == 6
    cluster.kill_node(second)  # SIGKILL: its segment stays registered for client_ttl
    kv = KV(64)
    async with replica(tier_on(cluster), kv, cpu_blocks=32) as reader:
        gpu = iter(range(64))
        for k in on_first + on_second:
            block = next(gpu)
            found = await asyncio.wait_for(reader.load_prefix([k], [block]), GUARD)
            assert found == (k in on_first)
            if found:
                assert kv.holds([block], [k])
        stats = mooncake_stats(reader)
        assert stats.blocks_read == 6 and stats.read_failures == 6
        assert stats.transfer_failed + stats.not_found == 6
        assert stats.negative_cached == 6 and stats.breaker.state == "closed"
    # Once the master drops the dead segment, the cluster takes and serves new blocks.
    await asyncio.to_thread(_wait_segments, cluster, 1)
    fresh = keys(*[f"after/{i}" for i in range(4)])
    kv_a, kv_b = KV(64), KV(64)
    async with replica(tier_on(cluster), kv_a) as a:
        kv_a.write([0, 1, 2, 3], fresh)
        await a.store(fresh, [0, 1, 2, 3])
        await a.drain()
        assert mooncake_stats(a).blocks_written == 4
    async with replica(tier_on(cluster), kv_b) as b:
        assert await b.load_prefix(fresh, [10, 11, 12, 13]) == 4
        assert kv_b.holds([10, 11, 12, 13], fresh)


def _wait_segments(cluster: LocalCluster, n: int) -> None:
    import time

    deadline = time.monotonic() + GUARD
    while len(cluster.segments()) != n:
        assert time.monotonic() < deadline, cluster.segments()
        time.sleep(0.05)


async def test_a_killed_master_trips_the_breaker_the_cpu_tier_serves_and_the_tier_returns(
    mooncake_cluster: ClusterFactory,
) -> None:
    cluster = mooncake_cluster(1, segment_size=32 << 20)
    kv = KV(64)
    tier = tier_on(cluster, failure_threshold=1, io_timeout=1.0, lookup_timeout=0.5,
                   reset_after=0.2, max_reset_after=1.0)  # fmt: skip
    before, during, after = keys("a", "b"), keys("c", "d"), keys("e", "f")
    async with replica(tier, kv, cpu_blocks=32) as off:
        kv.write([0, 1, 2, 3, 4, 5], before + during + after)
        await off.store(before, [0, 1])
        await off.drain()
        assert mooncake_stats(off).blocks_written == 2
        cluster.stop_master()  # SIGKILL
        await off.store(during, [2, 3])  # the CPU pool takes them; the tier write fails
        await eventually(lambda: mooncake_stats(off).breaker.trips >= 1, "the breaker", GUARD)
        # The CPU tier serves on, and lookups past it cost no call while the breaker is open.
        gpu = [10, 11, 12, 13, 14]
        missing = keys("nowhere")
        assert await asyncio.wait_for(off.load_prefix(before + during + missing, gpu), GUARD) == 4
        assert kv.holds(gpu[:4], before + during)
        assert mooncake_stats(off).lookups_bypassed == 1
        cluster.start_master()  # same ports; it lost every object
        await asyncio.to_thread(cluster.wait_for_segments, 1)
        await eventually(lambda: mooncake_stats(off).breaker.state == "closed", "recovery", GUARD)
        stats = mooncake_stats(off)
        assert stats.connected
        written = stats.blocks_written
        await off.store(after, [4, 5])
        await off.drain()
        assert mooncake_stats(off).blocks_written == written + 2
    kv_b = KV(64)
    async with replica(tier_on(cluster), kv_b) as b:
        assert await b.load_prefix(after, [20, 21]) == 2
        assert kv_b.holds([20, 21], after)
        assert await b.load_prefix(before, [22, 23]) == 0  # lost with the old master


async def test_a_full_cluster_fails_stores_cleanly_and_counts_them(
    mooncake_cluster: ClusterFactory,
) -> None:
    # The master's own HTTP metadata server this time (the others use P2P handshakes).
    cluster = mooncake_cluster(1, segment_size=16 << 20, metadata="http")
    kv = PagesKV(64, page=256 << 10)  # 512 KiB blocks: 48 of them are 24 MiB
    ks = keys(*[f"full/{i}" for i in range(48)])
    blocks = list(range(48))
    async with replica(tier_on(cluster, max_write_blocks=64), kv, cpu_blocks=64) as a:  # type: ignore[arg-type]
        kv.write(blocks, ks)
        result = await a.store(ks, blocks)
        await a.drain()
        assert len(result.stored) == 48  # the CPU pool took them all
        stats = mooncake_stats(a)
        assert stats.pool_full > 0 and stats.blocks_written > 0
        assert stats.blocks_written + stats.pool_full == 48
        assert stats.breaker.state == "closed" and stats.rpc_failures == 0
        assert await a.load_prefix(ks, list(range(48))) == 48  # from the CPU pool
    kv_b = PagesKV(64, page=256 << 10)
    async with replica(tier_on(cluster), kv_b, cpu_blocks=64) as b:  # type: ignore[arg-type]
        for k in ks:  # whatever the cluster kept is exact; the rest are misses
            if await b.load_prefix([k], [0]) == 1:
                assert kv_b.holds([0], [k])
        assert mooncake_stats(b).blocks_read > 0


async def test_lookups_and_loads_racing_evictions_see_misses_never_wrong_bytes(
    mooncake_cluster: ClusterFactory,
) -> None:
    # 256 KiB blocks, 1 MiB per prefix, 48 prefixes through a 16 MiB cluster: the master
    # keeps evicting (objects whose 20 ms read leases ran out) while the reader looks up
    # and loads prefixes among the last 24 written, some of them gone or going.
    cluster = mooncake_cluster(1, segment_size=16 << 20, lease_ttl=0.02)
    kv_w, kv_r = PagesKV(64, page=128 << 10), PagesKV(64, page=128 << 10)
    rng = random.Random(0)
    prefixes = [keys(*[f"race/{p}/{i}" for i in range(4)]) for p in range(48)]
    written = 0
    loaded = 0
    writer_tier, reader_tier = tier_on(cluster, index_ttl=0.01), tier_on(cluster)
    async with (
        replica(writer_tier, kv_w, cpu_blocks=16) as writer,  # type: ignore[arg-type]
        replica(reader_tier, kv_r, cpu_blocks=8) as reader,  # type: ignore[arg-type]
    ):

        async def write() -> None:
            nonlocal written
            for ks in prefixes:
                kv_w.write([0, 1, 2, 3], ks)
                await writer.store(ks, [0, 1, 2, 3])
                await writer.drain()
                written += 1
                await asyncio.sleep(0.02)  # the master evicts every 10 ms

        async def read() -> None:
            nonlocal loaded
            while written < len(prefixes):
                if not written:
                    await asyncio.sleep(0.005)
                    continue
                ks = prefixes[rng.randrange(max(0, written - 24), written)]
                n = await reader.load_prefix(ks, [10, 11, 12, 13])
                assert kv_r.holds([10, 11, 12, 13][:n], ks[:n])
                loaded += n
                await asyncio.sleep(0.002)

        await asyncio.wait_for(asyncio.gather(write(), read()), GUARD * 2)
        stats = mooncake_stats(reader)
        assert stats.checksum_failures == stats.bad_trailers == 0
        assert stats.breaker.state == "closed"
        assert stats.blocks_read > 0 and loaded > 0  # some loads came from the cluster
        assert stats.lookup_misses + stats.read_failures > 0  # and some found it gone
    keys_left = cluster.metric("master_key_count")
    assert keys_left is not None and keys_left < 4 * len(prefixes)  # it evicted


@pytest.mark.parametrize("reader_row_trailers", [True, False])
async def test_one_buffer_blocks_go_through_a_real_cluster_byte_exact(
    mooncake_cluster: ClusterFactory, reader_row_trailers: bool
) -> None:
    # One canonical tensor of 256 KiB rows: the tier keeps each trailer after its row and
    # uses batch_put_from / batch_get_into; a replica with an arena reads the same objects.
    cluster = mooncake_cluster(1, segment_size=64 << 20)
    ks = keys(*[f"one/{i}" for i in range(12)])
    kv_a = PagesKV(16, page=256 << 10, layers=1)
    tier_a = tier_on(cluster)
    async with replica(tier_a, kv_a, cpu_blocks=16) as a:  # type: ignore[arg-type]
        (pool,) = a.spec.cpu_tensors  # type: ignore[attr-defined]
        assert pool.stride(0) == (256 << 10) + 4096
        kv_a.write(list(range(12)), ks)
        assert len((await a.store(ks, list(range(12)))).stored) == 12
        await asyncio.wait_for(a.drain(), GUARD)
        assert mooncake_stats(a).blocks_written == 12
    kv_b = PagesKV(16, page=256 << 10, layers=1)
    tier_b = tier_on(cluster, row_trailers=reader_row_trailers)
    async with replica(tier_b, kv_b, cpu_blocks=16) as b:  # type: ignore[arg-type]
        assert await asyncio.wait_for(b.load_prefix(ks, list(range(12))), GUARD) == 12
        assert kv_b.holds(list(range(12)), ks)
        stats = mooncake_stats(b)
        assert (stats.blocks_read, stats.read_failures, stats.checksum_failures) == (12, 0, 0)
