"""Cache control: prefetch, demote, retain and durable, on a FaultyTier under a real Offloader.

Stalls are FaultyStore's (a transfer blocks until ``release()``), so every test
waits on a condition, never on the clock: a deadline here is only ever the
shorter of two waits whose order the test fixes.
"""

from __future__ import annotations

import asyncio

import pytest

from aiokvo import Offloader
from aiokvo.errors import ConfigError, InvalidKeyError, OffloaderClosedError
from aiokvo.keys import OffloadKey
from aiokvo.testing import FaultyStore, offloader_leaks
from tests.offloader._harness import KV, faulty, fill, key, names, store_of

CPU_BLOCKS = 8


def in_pool(off: Offloader, ks: list[OffloadKey]) -> list[bool]:
    found = [off.manager.block_status(k) for k in ks]
    return [s is not None and bool(s.is_ready) for s in found]


async def spill(off: Offloader, kv: KV, ks: list[OffloadKey]) -> None:
    """Store ``ks`` (written through to the tier), then push them out of the CPU pool."""
    await fill(off, kv, ks)
    await fill(off, kv, names("filler", CPU_BLOCKS), start=32)
    assert not any(in_pool(off, ks))  # only the tier has them


async def stalled(store: FaultyStore) -> None:
    """Return once a transfer of ``store`` is stalled."""
    await asyncio.to_thread(store.stalled.wait, 30.0)
    assert store.stalled.is_set()


# ------------------------------------------------------------------ prefetch
async def test_prefetch_promotes_without_gpu_blocks_and_the_load_reads_the_pool() -> None:
    kv, tier = KV(), faulty()
    ks = names("p", 4)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        assert await off.prefetch(ks) == 4
        assert all(in_pool(off, ks))
        (t,) = off.statistics().tiers
        reads = t.blocks_read
        assert reads == 4
        assert await off.load_prefix(ks, [0, 1, 2, 3]) == 4
        assert kv.holds([0, 1, 2, 3], ks)
        stats = off.statistics()
        assert stats.tiers[0].blocks_read == reads  # no second read
        c = stats.control
        assert (c.prefetches, c.prefetches_completed, c.prefetches_late) == (1, 1, 0)
        assert (c.prefetched_blocks, c.prefetch_used_blocks, c.prefetch_wasted_blocks) == (4, 4, 0)
        assert offloader_leaks(off) == []


async def test_a_prefetch_that_finds_nothing_below_costs_one_lookup() -> None:
    kv, tier = KV(), faulty()
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        before = off.statistics().tiers[0].lookups
        assert await off.prefetch(names("nowhere", 6)) == 0
        (t,) = off.statistics().tiers
        assert t.lookups == before + 1 and t.reads == 0


async def test_prefetch_keeps_the_pools_part_of_the_prefix_and_adds_the_tiers() -> None:
    kv, tier = KV(), faulty()
    head, tail = names("h", 2), names("t", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, tail)
        await fill(off, kv, head, start=10)
        assert all(in_pool(off, head)) and not any(in_pool(off, tail))
        assert await off.prefetch(head + tail) == 5
        assert all(in_pool(off, head + tail))
        assert off.statistics().tiers[0].blocks_read == 3
        assert offloader_leaks(off) == []


async def test_a_load_waits_for_a_prefetch_in_flight_instead_of_reading_twice() -> None:
    kv, tier = KV(), faulty()
    store = store_of(tier)
    ks = names("w", 4)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        reads = off.statistics().tiers[0].reads
        store.stall()
        prefetch = asyncio.create_task(off.prefetch(ks))
        await stalled(store)
        load = asyncio.create_task(off.load_prefix(ks, [0, 1, 2, 3]))
        for _ in range(20):  # the load reaches its wait (no read of its own)
            await asyncio.sleep(0)
        assert not load.done()
        assert off.statistics().store_waits == 1
        store.release()
        assert await prefetch == 4
        assert await load == 4
        assert kv.holds([0, 1, 2, 3], ks)
        assert off.statistics().tiers[0].reads == reads + 1
        assert offloader_leaks(off) == []


async def test_one_requests_stalled_reads_do_not_hold_up_anothers() -> None:
    kv, tier = KV(), faulty()
    store = store_of(tier)
    slow, fast = names("slow", 2), names("fast", 2)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, slow + fast)
        store.stall()  # the next transfer: the slow request's read
        slow_task = asyncio.create_task(off.prefetch(slow))
        await stalled(store)
        assert await off.prefetch(fast) == 2  # its own lane, while the other still hangs
        assert store.stalled.is_set() and not slow_task.done()
        store.release()
        assert await slow_task == 2
        assert offloader_leaks(off) == []


async def test_a_prefetch_past_its_deadline_returns_and_the_promotion_lands_later() -> None:
    kv, tier = KV(), faulty()
    store = store_of(tier)
    ks = names("d", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        store.stall()
        assert await off.prefetch(ks, deadline=0.05) == 0  # the read is held until release
        c = off.statistics().control
        assert (c.prefetches_late, c.prefetched_blocks) == (1, 0)
        store.release()
        await off.drain()
        assert all(in_pool(off, ks))
        assert off.statistics().control.prefetched_blocks == 3
        assert offloader_leaks(off) == []


async def test_prefetched_blocks_the_pool_drops_unused_are_counted_wasted() -> None:
    kv, tier = KV(), faulty()
    ks = names("x", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        assert await off.prefetch(ks) == 3
        await fill(off, kv, names("push", CPU_BLOCKS), start=40)
        c = off.statistics().control
        assert (c.prefetch_used_blocks, c.prefetch_wasted_blocks) == (0, 3)


async def test_blocks_pinned_before_the_prefetch_resumes_count_as_used() -> None:
    # The promoted keys are ready the moment the promotion completes; the prefetch's own
    # coroutine resumes two loop turns later. A scheduler that pins them in between used
    # them (bench_agentic found them counted wasted once the pool dropped them).
    kv, tier = KV(), faulty()
    store = store_of(tier)
    ks = names("u", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        store.stall()
        prefetch = asyncio.create_task(off.prefetch(ks))
        await stalled(store)
        store.release()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 30
        while not all(in_pool(off, ks)) and loop.time() < give_up:
            await asyncio.sleep(0)  # every loop turn: pin them as soon as they are ready
        assert not prefetch.done()
        lease = off.pin_prefix(ks)
        assert lease is not None and lease.count == 3
        lease.release()
        assert await prefetch == 3
        await fill(off, kv, names("push", CPU_BLOCKS), start=40)  # the pool drops them
        c = off.statistics().control
        assert (c.prefetched_blocks, c.prefetch_used_blocks, c.prefetch_wasted_blocks) == (3, 3, 0)
        assert offloader_leaks(off) == []


@pytest.mark.parametrize("point", ["store", "read"])
async def test_a_cancelled_prefetch_leaves_nothing_behind(point: str) -> None:
    kv, tier = KV(), faulty()
    store = store_of(tier)
    ks = names("c", 4)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        if point == "store":  # cancelled while it waits for a store of its prefix
            kv.write([0, 1, 2, 3], ks)
            storing = asyncio.create_task(off.store(ks, [0, 1, 2, 3]))
            await asyncio.sleep(0)
            task = asyncio.create_task(off.prefetch(ks))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await storing).ok
        else:  # cancelled while its promotion reads
            await spill(off, kv, ks)
            store.stall()
            task = asyncio.create_task(off.prefetch(ks))
            await stalled(store)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            store.release()
        await off.drain()
        assert all(in_pool(off, ks))  # the copy went on and completed itself
        assert offloader_leaks(off) == []
        assert off.statistics().manager.pinned_blocks == 0


async def test_prefetch_without_tiers_reports_the_pools_prefix() -> None:
    kv = KV()
    ks = names("n", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches) as off:
        await fill(off, kv, ks[:2])
        assert await off.prefetch(ks) == 2


async def test_bad_input_is_refused_before_anything_changes() -> None:
    kv, tier = KV(), faulty()
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        with pytest.raises(ConfigError, match=r"deadline.*-1"):
            await off.prefetch(names("b", 1), deadline=-1)
        with pytest.raises(ConfigError, match=r"timeout.*nan"):
            await off.durable(names("b", 1), timeout=float("nan"))
        with pytest.raises(InvalidKeyError):
            await off.prefetch(key("bare"))  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            await off.demote(key("bare"))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="'NOPE'"):
            await off.durable(names("b", 1), tier="NOPE")
        with pytest.raises(ConfigError, match="ttl"):
            off.retain(names("b", 1), ttl=0)
        c = off.statistics().control
        assert (c.prefetches, c.demotions, c.durable_waits) == (0, 0, 0)
        assert c.retention is not None and c.retention.made == 0
    with pytest.raises(OffloaderClosedError):
        await off.prefetch(names("b", 1))


# -------------------------------------------------------------------- demote
async def test_demote_frees_the_pool_and_the_blocks_come_back_from_the_tier() -> None:
    kv, tier = KV(), faulty(admit_after=100)  # write-through never admits them
    ks = names("m", 4)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await fill(off, kv, ks)
        assert tier.committed(ks) == []
        assert await off.demote(ks) == 4
        assert not any(in_pool(off, ks)) and tier.committed(ks) == ks
        for tensor in kv.layers[0]:
            tensor[:4] = 0
        assert await off.load_prefix(ks, [0, 1, 2, 3]) == 4
        assert kv.holds([0, 1, 2, 3], ks)
        stats = off.statistics()
        assert stats.hits_by_medium["FAULTY"] == 4
        assert (stats.control.demotions, stats.control.demoted_blocks) == (1, 4)
        assert offloader_leaks(off) == []


async def test_demote_keeps_what_the_tier_did_not_commit_and_what_a_lease_reads() -> None:
    kv, tier = KV(), faulty(admit_after=100)
    ks = names("k", 4)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await fill(off, kv, ks)
        store_of(tier).fail(ks[1], "write")
        lease = off.pin_prefix(ks[3:])
        assert lease is not None and lease.count == 1
        assert await off.demote(ks) == 2  # ks[1] failed to write, ks[3] is leased
        assert in_pool(off, ks) == [False, True, False, True]
        lease.release()
        assert offloader_leaks(off) == []


async def test_demote_and_durable_need_a_tier() -> None:
    kv = KV()
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches) as off:
        with pytest.raises(ConfigError, match="demote needs a tier"):
            await off.demote(names("z", 1))
        with pytest.raises(ConfigError, match="durable needs a tier"):
            await off.durable(names("z", 1))


# ------------------------------------------------------------------- durable
async def test_durable_writes_what_the_tier_lacks_and_waits_for_the_commit() -> None:
    kv, tier = KV(), faulty(admit_after=100)
    ks = names("u", 4)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await fill(off, kv, ks)
        assert await off.durable(ks) == 4
        assert tier.committed(ks) == ks and all(in_pool(off, ks))  # durable frees nothing
        assert await off.durable(ks, tier="FAULTY") == 4  # already there: no write
        assert off.statistics().tiers[0].writes == 1
        assert off.statistics().control.durable_waits == 2


async def test_durable_waits_for_the_write_through_in_flight() -> None:
    kv, tier = KV(), faulty()
    store = store_of(tier)
    ks = names("v", 2)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        store.stall()
        kv.write([0, 1], ks)
        assert (await off.store(ks, [0, 1])).ok  # its write-through is now stalled
        await stalled(store)
        waiting = asyncio.create_task(off.durable(ks))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()
        store.release()
        assert await waiting == 2
        assert off.statistics().tiers[0].writes == 1  # the same write, not a second


async def test_durable_returns_at_its_timeout_and_the_write_completes_itself() -> None:
    kv, tier = KV(), faulty(admit_after=100)
    store = store_of(tier)
    ks = names("t", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await fill(off, kv, ks)
        store.stall()
        assert await off.durable(ks, timeout=0.05) == 0
        assert off.statistics().control.durable_timeouts == 1
        store.release()
        await off.drain()
        assert tier.committed(ks) == ks
        assert offloader_leaks(off) == []


async def test_durable_defaults_to_the_lowest_tier() -> None:
    kv = KV()
    upper = faulty(medium="UPPER", admit_after=100)
    lower = faulty(medium="LOWER", admit_after=100)
    ks = names("l", 2)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[upper, lower]) as off:
        await fill(off, kv, ks)
        assert await off.durable(ks) == 2
        assert lower.committed(ks) == ks and upper.committed(ks) == []
        assert await off.durable(ks, tier=upper) == 2
        assert upper.committed(ks) == ks


# -------------------------------------------------------------------- retain
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "chain"])
async def test_retained_blocks_are_evicted_last_under_every_policy(policy: str) -> None:
    kv = KV()
    kept, others = names("r", 2), names("o", 6)
    config = kv.config(CPU_BLOCKS, eviction_policy=policy, retention_fraction=0.5)
    async with Offloader(config, kv.caches) as off:
        await fill(off, kv, kept)
        await fill(off, kv, others, start=10)
        with off.retain(kept, priority=1, ttl=3600) as held:
            assert held.alive
            await fill(off, kv, names("new", 4), start=20)  # 4 evictions: none of kept
            assert all(in_pool(off, kept))
        assert not held.alive
        await fill(off, kv, names("more", CPU_BLOCKS), start=30)
        assert not any(in_pool(off, kept))  # released: evicted like any other


async def test_retention_never_refuses_a_store() -> None:
    kv = KV()
    kept = names("all", 4)
    async with Offloader(kv.config(4, retention_fraction=1.0), kv.caches) as off:
        await fill(off, kv, kept)
        async with off.retain(kept, ttl=3600):
            fresh = names("fresh", 2)
            kv.write([10, 11], fresh)
            result = await off.store(fresh, [10, 11])
            assert result.ok and len(result.evicted) == 2
            retention = off.statistics().control.retention
            assert retention is not None and retention.evicted_retained == 2


async def test_retention_off_is_refused_with_the_setting_named() -> None:
    kv = KV()
    async with Offloader(kv.config(CPU_BLOCKS, retention_fraction=0), kv.caches) as off:
        assert off.statistics().control.retention is None
        with pytest.raises(ConfigError, match="retention_fraction=0"):
            off.retain(names("q", 1), ttl=1)


# ----------------------------------------------------------------- telemetry
async def test_the_hints_are_scraped_over_http_and_shown_by_watch() -> None:
    import io

    from aiokvo.telemetry.prometheus import start_metrics_server, totals_from_text
    from aiokvo.telemetry.watch import watch
    from tests.telemetry.scrape import parse, scrape, value

    kv, tier = KV(), faulty()
    ks = names("s", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        assert await off.prefetch(ks) == 3
        assert await off.durable(ks) == 3
        assert await off.demote(ks) == 3
        held = off.retain(names("keep", 2), priority=2, ttl=3600)
        async with start_metrics_server(off, 0) as server:
            text = await scrape(server.url)
            samples = parse(text)
            assert value(samples, "aiokvo_control_prefetches_total") == 1
            assert value(samples, "aiokvo_control_prefetched_blocks_total") == 3
            assert value(samples, "aiokvo_control_demoted_blocks_total") == 3
            assert value(samples, "aiokvo_control_durable_waits_total") == 1
            assert value(samples, "aiokvo_retention_retained_blocks") == 2
            assert value(samples, "aiokvo_retention_budget_blocks") == CPU_BLOCKS // 4
            assert "# HELP aiokvo_control_prefetches_late_total Prefetches whose deadline" in text
            control = totals_from_text(text).control
            assert control["prefetches"] == 1 and control["retention_made"] == 1
            out = io.StringIO()
            assert await watch(metrics=[server.url], interval=0.05, duration=0.2,
                               plain=True, out=out) == 0  # fmt: skip
        held.release()
    lines = [line for line in out.getvalue().splitlines() if "hints" in line]
    assert lines, out.getvalue()
    assert "prefetch 1 (late 0)" in lines[-1] and "demoted 3" in lines[-1]
    assert "retained 2/2" in lines[-1]
