"""MooncakeTier under an Offloader, against the in-process FakeMooncakeCluster.

What only failures show (vanished, corrupt, foreign or short objects, a full
pool, a dead or hung master, a failed setup) is injected here; the same
workflows against a real cluster are in test_cluster.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aiokvo import Offloader
from aiokvo.specs import OffloadingEvent, ReqContext
from aiokvo.testing.mooncake_fake import FakeMooncakeCluster
from aiokvo.tiers.mooncake.format import TRAILER_BYTES, pack_trailer
from tests.offloader._harness import KV, PAGE, keys
from tests.tiers.mooncake._support import eventually, fake_tier, mooncake_stats, replica

pytestmark = pytest.mark.usefixtures("aiokvo_leak_check")

BLOCK_BYTES = 2 * PAGE  # two layers of PAGE bytes per block


@pytest.fixture
def cluster() -> FakeMooncakeCluster:
    return FakeMooncakeCluster()


async def store_on(off: Offloader, kv: KV, ks: list, first_block: int = 0) -> None:
    blocks = list(range(first_block, first_block + len(ks)))
    kv.write(blocks, ks)
    result = await off.store(ks, blocks)
    assert len(result.stored) == len(ks)
    await off.drain()  # the write-through too


async def test_blocks_one_replica_stored_are_loaded_byte_exact_by_another(
    cluster: FakeMooncakeCluster,
) -> None:
    ks = keys(*"abcd")
    kv_a, kv_b = KV(64), KV(64)
    tier_a, tier_b = fake_tier(cluster), fake_tier(cluster)
    async with replica(tier_a, kv_a) as a:
        await store_on(a, kv_a, ks)
        assert mooncake_stats(a).blocks_written == 4
    names = [tier_a.store.object_name(k) for k in ks]
    assert sorted(cluster.objects) == sorted(names)
    assert all(n.startswith(f"aiokvo/{tier_a.fingerprint.name()}/") for n in names)
    assert {len(cluster.objects[n]) for n in names} == {BLOCK_BYTES + TRAILER_BYTES}
    async with replica(tier_b, kv_b) as b:
        assert await b.load_prefix(ks, [20, 21, 22, 23]) == 4
        assert kv_b.holds([20, 21, 22, 23], ks)
        stats = b.statistics()
        assert stats.hits_by_medium == {"CPU": 0, "MOONCAKE": 4}
        tier = mooncake_stats(b)
        assert (tier.blocks_read, tier.read_failures, tier.remote_lookups) == (4, 0, 1)
        # Now in B's CPU pool: the next load asks nobody.
        assert await b.load_prefix(ks, [30, 31, 32, 33]) == 4
        assert mooncake_stats(b).remote_lookups == 1
        assert b.statistics().hits_by_medium["CPU"] == 4


@pytest.mark.parametrize("other", [{"model_id": "another-model"}, {"key_prefix": "staging"}])
async def test_another_model_or_prefix_never_sees_the_blocks(
    cluster: FakeMooncakeCluster, other: dict[str, str]
) -> None:
    ks = keys(*"ab")
    kv_a = KV(64)
    async with replica(fake_tier(cluster), kv_a) as a:
        await store_on(a, kv_a, ks)
    async with replica(fake_tier(cluster, **other)) as b:
        assert await b.load_prefix(ks, [20, 21]) == 0
        assert mooncake_stats(b).lookup_misses == 1


async def test_a_vanished_block_is_a_miss_for_that_key_and_not_asked_again(
    cluster: FakeMooncakeCluster,
) -> None:
    ks = keys(*"abcd")
    kv_a, kv_b = KV(64), KV(64)
    tier_a, tier_b = fake_tier(cluster), fake_tier(cluster)
    async with replica(tier_a, kv_a) as a:
        await store_on(a, kv_a, ks)
    cluster.stale.add(tier_a.store.object_name(ks[2]))  # "exists", but every get is -704
    async with replica(tier_b, kv_b) as b:
        assert await b.load_prefix(ks, [20, 21, 22, 23]) == 2
        assert kv_b.holds([20, 21], ks[:2])
        stats = mooncake_stats(b)
        assert (stats.not_found, stats.read_failures, stats.negative_cached) == (1, 1, 1)
        assert sum(t.read_failures for t in b.statistics().tiers) == 1
        asked = cluster.calls.exists
        assert await b.load_prefix(ks, [30, 31, 32, 33]) == 2  # c: negative, not asked
        assert cluster.calls.exists == asked
        assert mooncake_stats(b).negative_hits == 1
        assert stats.breaker.state == "closed"


async def test_corrupt_bytes_are_a_miss_and_the_object_is_removed(
    cluster: FakeMooncakeCluster,
) -> None:
    ks = keys(*"abc")
    kv_a, kv_b = KV(64), KV(64)
    tier_a = fake_tier(cluster)
    async with replica(tier_a, kv_a) as a:
        await store_on(a, kv_a, ks)
    bad = tier_a.store.object_name(ks[1])
    cluster.corrupt(bad, offset=PAGE + 3)  # in the second layer's row
    async with replica(fake_tier(cluster), kv_b) as b:
        assert await b.load_prefix(ks, [20, 21, 22]) == 1
        assert kv_b.holds([20], ks[:1])
        assert mooncake_stats(b).checksum_failures == 1
        await eventually(lambda: bad not in cluster.objects, "the corrupt object's removal")
        assert mooncake_stats(b).removals == 1
        # The CPU pool never took the bad bytes: the key is absent there.
        assert b.manager.lookup(ks[1], ReqContext()) is False


@pytest.mark.parametrize("damage", ["foreign trailer", "short object", "longer object"])
async def test_an_object_that_is_not_this_block_is_a_miss(
    cluster: FakeMooncakeCluster, damage: str
) -> None:
    ks = keys(*"ab")
    kv_a = KV(64)
    tier_a = fake_tier(cluster)
    async with replica(tier_a, kv_a) as a:
        await store_on(a, kv_a, ks)
    name = tier_a.store.object_name(ks[0])
    data = cluster.objects[name]
    if damage == "foreign trailer":  # right length, another key's trailer
        trailer = pack_trailer(tier_a.fingerprint.digest()[:16], ks[1], BLOCK_BYTES, 0)
        cluster.objects[name] = data[:BLOCK_BYTES] + trailer
    elif damage == "short object":
        cluster.objects[name] = data[:-10]
    else:
        cluster.objects[name] = data + b"\0" * 64
    async with replica(fake_tier(cluster)) as b:
        assert await b.load_prefix(ks, [20, 21]) == 0
        stats = mooncake_stats(b)
        assert stats.read_failures == 1
        assert stats.bad_trailers + stats.size_mismatches == 1


async def test_a_full_cluster_fails_the_store_for_those_keys_only(
    cluster: FakeMooncakeCluster,
) -> None:
    cluster.capacity_bytes = 2 * (BLOCK_BYTES + TRAILER_BYTES)
    ks = keys(*"abcd")
    kv_a = KV(64)
    async with replica(fake_tier(cluster), kv_a) as a:
        await store_on(a, kv_a, ks)
        stats = mooncake_stats(a)
        assert (stats.blocks_written, stats.pool_full, stats.write_failures) == (2, 2, 2)
        assert stats.breaker.state == "closed"  # a full pool is not a failing cluster
        assert await a.load_prefix(ks, [20, 21, 22, 23]) == 4  # the CPU pool has them all
    async with replica(fake_tier(cluster)) as b:
        assert await b.load_prefix(ks, [20, 21, 22, 23]) == 2


async def test_a_dead_master_trips_the_breaker_the_cpu_tier_serves_and_the_tier_comes_back(
    cluster: FakeMooncakeCluster,
) -> None:
    kv = KV(64)
    tier = fake_tier(cluster)
    async with replica(tier, kv, cpu_blocks=32) as off:
        await store_on(off, kv, keys("a", "b"))
        cluster.down = True
        for i, name in enumerate(("c", "d", "e")):
            await store_on(off, kv, keys(name), first_block=10 + i)
        stats = mooncake_stats(off)
        assert stats.breaker.trips == 1
        assert stats.rpc_failures == 2 and stats.writes_refused >= 1
        # The CPU pool serves what it holds; a lookup past it costs no call.
        calls = cluster.calls.exists
        assert await off.load_prefix(keys("a", "b", "zz"), [40, 41, 42]) == 2
        assert kv.holds([40, 41], keys("a", "b"))
        assert cluster.calls.exists == calls
        assert mooncake_stats(off).lookups_bypassed >= 1
        cluster.down = False
        await eventually(lambda: mooncake_stats(off).breaker.state == "closed", "recovery")
        await store_on(off, kv, keys("f"), first_block=20)
        assert tier.store.object_name(keys("f")[0]) in cluster.objects


async def test_a_hung_master_costs_a_lookup_its_deadline_and_no_wrong_answer(
    cluster: FakeMooncakeCluster,
) -> None:
    ks = keys(*"ab")
    kv_a = KV(64)
    async with replica(fake_tier(cluster), kv_a) as a:
        await store_on(a, kv_a, ks)
    tier = fake_tier(cluster, lookup_timeout=0.05)
    async with replica(tier) as b:
        cluster.block()
        try:
            found = await asyncio.wait_for(b.load_prefix(ks, [20, 21]), 30)
            assert found == 0
            stats = mooncake_stats(b)
            assert stats.lookup_timeouts == 1 and stats.lookup_failures == 1
        finally:
            cluster.unblock()
        await eventually(lambda: mooncake_stats(b).breaker.state == "closed", "recovery")
        assert await b.load_prefix(ks, [20, 21]) == 2


async def test_a_transfer_past_its_deadline_keeps_its_cpu_blocks_until_the_call_returns(
    cluster: FakeMooncakeCluster,
) -> None:
    kv = KV(64)
    (k,) = keys("a")
    # A deadline the put's thread surely starts within on a loaded machine (a put
    # not started by its deadline is never made: nothing would be overdue), and
    # short enough to wait out.
    async with replica(fake_tier(cluster, io_timeout=1.0), kv) as off:
        cluster.block()
        try:
            kv.write([0], [k])
            await off.store([k], [0])
            await eventually(lambda: mooncake_stats(off).timeouts == 1, "the overdue put")
            assert cluster.calls.put == 1  # it is inside the hung cluster
            status = off.manager.block_status(k)
            assert status is not None and status.ref_cnt > 0  # Mooncake may still read it
        finally:
            cluster.unblock()
        await off.drain()
        status = off.manager.block_status(k)
        assert status is not None and status.ref_cnt == 0
        stats = mooncake_stats(off)
        assert stats.timeouts == 1 and stats.blocks_written == 1


async def test_a_failed_setup_leaves_the_tier_out_until_it_connects(
    cluster: FakeMooncakeCluster,
) -> None:
    cluster.setup_rc = -1
    kv = KV(64)
    tier = fake_tier(cluster)
    async with replica(tier, kv) as off:
        await store_on(off, kv, keys("a"))
        stats = mooncake_stats(off)
        assert not stats.connected and stats.setup_failures >= 1
        assert stats.writes_refused == 1 and cluster.objects == {}
        cluster.setup_rc = 0
        await eventually(lambda: mooncake_stats(off).connected, "the reconnection")
        await store_on(off, kv, keys("b"), first_block=1)
        assert list(cluster.objects) == [tier.store.object_name(keys("b")[0])]


async def test_lookups_of_one_loop_iteration_share_one_call(cluster: FakeMooncakeCluster) -> None:
    groups = [keys(f"{i}a", f"{i}b") for i in range(6)]
    kv_a = KV(64)
    async with replica(fake_tier(cluster), kv_a, cpu_blocks=32) as a:
        for i, ks in enumerate(groups):
            await store_on(a, kv_a, ks, first_block=2 * i)
    async with replica(fake_tier(cluster), cpu_blocks=32) as b:
        before = cluster.calls.exists
        found = await asyncio.gather(
            *(b.load_prefix(ks, [20 + 2 * i, 21 + 2 * i]) for i, ks in enumerate(groups))
        )
        assert found == [2] * 6
        assert cluster.calls.exists == before + 1
        assert len(cluster.calls.names_asked[-1]) == 12


async def test_stored_blocks_are_events_with_the_tiers_medium(cluster: FakeMooncakeCluster) -> None:
    ks = keys(*"ab")
    kv = KV(64)
    cluster.capacity_bytes = BLOCK_BYTES + TRAILER_BYTES  # room for one
    async with replica(fake_tier(cluster), kv) as off, off.subscribe() as events:
        await store_on(off, kv, ks)
        seen = [events.receive_nowait() for _ in range(2)]
    assert seen[0] == OffloadingEvent(ks, "CPU", False)
    assert seen[1] == OffloadingEvent(ks[:1], "MOONCAKE", False)


async def test_replicas_and_placement_go_into_every_put(cluster: FakeMooncakeCluster) -> None:
    kv = KV(64)
    tier = fake_tier(cluster, replica_num=2)
    async with replica(tier, kv) as off:
        await store_on(off, kv, keys("a"))
    assert set(cluster.replicas.values()) == {2}
    (store,) = cluster.stores
    assert store.closed and store.buffers == {}  # unregistered, then closed once
    assert cluster.calls.close == 1


async def test_a_large_transfer_goes_in_pipelined_chunks_each_block_verified(
    cluster: FakeMooncakeCluster,
) -> None:
    ks = keys(*"abcdefgh")
    kv_a, kv_b = KV(64), KV(64)
    chunked = {"pipeline_bytes": 2 * BLOCK_BYTES}  # two blocks per batch call
    tier_a = fake_tier(cluster, **chunked)
    async with replica(tier_a, kv_a) as a:
        await store_on(a, kv_a, ks)
    assert cluster.calls.put == 4 and len(cluster.objects) == 8
    cluster.corrupt(tier_a.store.object_name(ks[5]), offset=1)
    async with replica(fake_tier(cluster, **chunked), kv_b) as b:
        gpu = list(range(20, 28))
        assert await b.load_prefix(ks, gpu) == 5
        assert kv_b.holds(gpu[:5], ks[:5])
        assert cluster.calls.get == 4
        stats = mooncake_stats(b)
        assert (stats.blocks_read, stats.checksum_failures) == (7, 1)  # g and h are fine too


async def test_a_chunk_the_master_refused_stops_the_transfer(
    cluster: FakeMooncakeCluster,
) -> None:
    ks = keys(*"abcdefgh")
    kv = KV(64)
    tier = fake_tier(cluster, pipeline_bytes=2 * BLOCK_BYTES, failure_threshold=5)
    async with replica(tier, kv) as off:
        await off.open()
        for k in ks[2:4]:  # the second call: -900 for both of its objects
            cluster.codes[tier.store.object_name(k)] = -900
        await store_on(off, kv, ks)
        stats = mooncake_stats(off)
    assert cluster.calls.put == 2  # the third and fourth were never made
    assert sorted(cluster.objects) == sorted(tier.store.object_name(k) for k in ks[:2])
    assert (stats.blocks_written, stats.write_failures, stats.rpc_failures) == (2, 6, 1)


async def test_a_promotion_that_ends_while_the_next_tier_looks_up_is_not_waited_for(
    cluster: FakeMooncakeCluster, disk_tier_path: Path
) -> None:
    # The disk tier promotes a, b; the Mooncake lookup for c, d is held until that
    # promotion has ended. The load must then see it ended (not wait out a deadline).
    from aiokvo.tiers import DiskTier

    a_b, c_d = keys("a", "b"), keys("c", "d")
    kv_w = KV(64)
    async with replica(fake_tier(cluster), kv_w) as writer:
        await store_on(writer, kv_w, c_d)
    # Deadlines nothing here should reach, however slow the machine: the lookup is
    # held until the disk promotion ends, and neither may time out meanwhile.
    disk = DiskTier(disk_tier_path, capacity_bytes=1 << 20, model_id="test-model",
                    io_timeout=30.0, refresh_interval=0)  # fmt: skip
    kv = KV(64)
    off = Offloader(kv.config(4), kv.caches, tiers=[disk, fake_tier(cluster, lookup_timeout=30.0)])
    async with off:
        await store_on(off, kv, a_b)
        await store_on(off, kv, keys("e", "f", "g", "h"), first_block=2)  # a, b leave the pool
        assert off.manager.lookup(a_b[0], ReqContext()) is False
        cluster.block()

        async def release_after_the_disk_promotion() -> None:
            await eventually(lambda: off.statistics().tiers[0].blocks_read >= 2, "disk promotion")
            cluster.unblock()

        releaser = asyncio.create_task(release_after_the_disk_promotion())
        found = await off.load_prefix(a_b + c_d, [20, 21, 22, 23])
        await releaser
        stats = off.statistics()
        assert found == 4 and kv.holds([20, 21, 22, 23], a_b + c_d)
        assert stats.promotion_timeouts == 0
        assert stats.hits_by_medium["DISK"] == 2 and stats.hits_by_medium["MOONCAKE"] == 2


async def test_the_metrics_exporter_reads_the_mooncake_tier_like_any_tier(
    cluster: FakeMooncakeCluster,
) -> None:
    from aiokvo.telemetry.prometheus import start_metrics_server
    from tests.telemetry.scrape import parse, scrape, value

    ks = keys(*"abcd")
    kv_a, kv_b = KV(64), KV(64)
    async with replica(fake_tier(cluster), kv_a) as a:
        await store_on(a, kv_a, ks)
    async with replica(fake_tier(cluster), kv_b) as b, start_metrics_server(b, 0) as server:
        assert await b.load_prefix(ks, [20, 21, 22, 23]) == 4
        s = parse(await scrape(server.url))
    mooncake = {"medium": "MOONCAKE"}
    assert value(s, "aiokvo_hit_blocks_total", **mooncake) == 4
    assert value(s, "aiokvo_breaker_state", **mooncake, state="closed") == 1
    assert value(s, "aiokvo_checksum_failures_total", **mooncake) == 0
