"""The tier engine, tested once for every tier: an Offloader over aiokvo.testing's FaultyTier.

Every tier is the same StoreTier around its store, so what the engine
promises (a fault is a counted miss and never a wrong byte, deadlines,
the breaker's one gate, a bounded close, determinism) is checked here on a
store that fails on purpose; the disk and Mooncake tests check their stores.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from aiokvo import Offloader
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey
from aiokvo.testing import Faults, FaultyTier, offloader_leaks
from aiokvo.tiers.io import STALLED_AFTER, pick_slot
from tests.offloader._harness import KV, faulty, fill, key, names, store_of

CPU_BLOCKS = 8


def clear(kv: KV, blocks: range) -> None:
    for tensor in kv.layers[0]:
        tensor[list(blocks)] = 0


async def spill(off: Offloader, kv: KV, ks: list[OffloadKey]) -> None:
    """Store ``ks`` (written through to the tier), then push them out of the CPU pool."""
    await fill(off, kv, ks)
    await fill(off, kv, names("filler", CPU_BLOCKS), start=32)
    assert all(off.manager.block_status(k) is None for k in ks)  # only the tier has them


async def test_blocks_the_pool_evicted_come_back_from_the_tier_byte_exact() -> None:
    kv, tier = KV(), faulty()
    ks = names("a", 4)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        clear(kv, range(4))
        assert await off.load_prefix(ks, [0, 1, 2, 3]) == 4
        assert kv.holds([0, 1, 2, 3], ks)
        stats = off.statistics()
        assert stats.hits_by_medium["FAULTY"] == 4
        (t,) = stats.tiers
        assert (t.reads, t.blocks_read, t.read_failures) == (1, 4, 0)
        assert t.blocks_written == 4 + CPU_BLOCKS
        assert t.bytes_read == 4 * kv.caches.page_bytes_per_block
        assert offloader_leaks(off) == []


async def test_a_flipped_block_is_a_counted_miss_never_a_wrong_byte() -> None:
    kv, tier = KV(), faulty()
    ks = names("f", 4)
    store_of(tier).flip(ks[2])
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        events = off.subscribe(maxsize=1000)
        await spill(off, kv, ks)
        clear(kv, range(4))
        assert await off.load_prefix(ks, [0, 1, 2, 3]) == 2  # the prefix ends at the bad one
        assert kv.holds([0, 1], ks[:2])
        assert not kv.layers[0][0][2].any()  # nothing of the corrupt block reached the GPU
        (t,) = off.statistics().tiers
        assert (t.checksum_failures, t.read_failures, t.removals) == (1, 1, 1)
        assert t.failure_causes == {"corrupt": 1}
        assert t.breaker.failures == 0  # bad data is not a failing store
        removed = [e for e in events.drain_nowait()
                   if getattr(e, "medium", None) == "FAULTY" and e.removed]  # fmt: skip
        assert [list(e.keys) for e in removed] == [[ks[2]]]
        assert not tier.index.lookup([ks[2]], time.monotonic())  # dropped from the tier
        await events.aclose()


async def test_eio_reads_trip_the_breaker_and_the_pool_serves_on() -> None:
    kv, tier = KV(), faulty(failure_threshold=2, reset_after=60.0)
    ks = names("e", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        store = store_of(tier)
        for _ in range(2):
            store.fail(ks[0], "read")
            assert await off.load_prefix(ks, [0, 1, 2]) == 0
        (t,) = off.statistics().tiers
        assert t.breaker.state == "open" and t.store_failures == 2
        assert t.failure_causes == {"eio": 2}
        before = t.lookups_bypassed
        assert await off.load_prefix(ks, [0, 1, 2]) == 0  # not even asked
        hot = names("hot", 2)
        await fill(off, kv, hot, start=40)
        assert await off.load_prefix(hot, [40, 41]) == 2  # the CPU pool still serves
        (t,) = off.statistics().tiers
        assert t.lookups_bypassed == before + 1
        assert offloader_leaks(off) == []


async def test_the_one_gate_counts_every_operation_it_turns_away() -> None:
    # A tier's breaker open: lookups, offers and writes turned away each count one
    # rejection, whatever the store (the disk and Mooncake tiers used to differ).
    kv, tier = KV(), faulty(failure_threshold=1, reset_after=60.0)
    ks = names("g", 2)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        store_of(tier).fail(ks[0], "read")
        await off.load_prefix(ks, [0, 1])
        (t,) = off.statistics().tiers
        assert t.breaker.state == "open"
        rejected = t.breaker.rejected
        await off.load_prefix(ks, [0, 1])  # one lookup turned away
        await fill(off, kv, names("new", 2), start=20)  # one offer turned away
        (t,) = off.statistics().tiers
        assert t.breaker.rejected == rejected + 2
        assert t.writes_refused == 2


async def test_a_vanished_block_is_a_miss_and_is_forgotten() -> None:
    kv, tier = KV(), faulty()
    ks = names("v", 3)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        store_of(tier).vanish(ks[1])
        clear(kv, range(3))
        assert await off.load_prefix(ks, [0, 1, 2]) == 1
        (t,) = off.statistics().tiers
        assert t.failure_causes == {"missing": 1} and t.checksum_failures == 0
        assert tier.index.lookup(ks, time.monotonic()) == 1


async def test_a_stalled_read_times_out_and_the_load_goes_on_without_it() -> None:
    kv, tier = KV(), faulty(io_timeout=0.2)
    ks = names("s", 2)
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        await spill(off, kv, ks)
        store = store_of(tier)
        store.stall()
        assert await off.load_prefix(ks, [0, 1]) == 0  # returned at the deadline
        (t,) = off.statistics().tiers
        assert t.timeouts == 1 and off.statistics().promotion_timeouts == 1
        store.release()
        await off.drain()
        (t,) = off.statistics().tiers
        assert t.reads == 1 and t.timeouts == 1  # the late outcome changed nothing
        assert offloader_leaks(off) == []


async def test_close_abandons_a_stuck_transfer_within_its_deadline_and_counts_it() -> None:
    # A hung disk or server: aclose() must still return (DESIGN: bounded and live).
    kv, tier = KV(), faulty(io_timeout=0.3, stall_seconds=30.0)
    ks = names("c", 2)
    off = Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier])
    await off.open()
    await spill(off, kv, ks)
    store = store_of(tier)
    store.stall()
    load = asyncio.ensure_future(off.load_prefix(ks, [0, 1]))
    await asyncio.to_thread(store.stalled.wait, 30)
    assert await load == 0
    start = time.monotonic()
    await asyncio.wait_for(off.aclose(), 20)
    assert time.monotonic() - start < 20
    t = tier.statistics()
    assert t.abandoned == 1
    assert not t.connected
    store.release()  # the stuck thread finishes and the store closes behind it


async def test_faults_are_deterministic_for_a_seed() -> None:
    async def run(seed: int) -> tuple[int, dict[str, int], list[int]]:
        kv = KV()
        tier = faulty(faults=Faults(seed=seed, flip=0.3, eio=0.2, vanish=0.2))
        ks = names("d", 12)
        async with Offloader(kv.config(CPU_BLOCKS * 2), kv.caches, tiers=[tier]) as off:
            await fill(off, kv, ks[:6])
            await fill(off, kv, ks[6:], start=6)
            await fill(off, kv, names("filler", 16), start=32)
            loaded = [await off.load_prefix(ks[i : i + 3], [0, 1, 2]) for i in range(0, 12, 3)]
            (t,) = off.statistics().tiers
            return t.read_failures + t.write_failures, dict(t.failure_causes), loaded

    first = await run(11)
    assert first == await run(11)
    assert first[0] > 0  # the plan did inject something
    assert first != await run(12)


def test_fault_plans_and_stores_refuse_bad_settings() -> None:
    with pytest.raises(ConfigError, match="flip"):
        Faults(flip=1.5)
    with pytest.raises(ConfigError, match="seed"):
        Faults(seed="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="capacity_blocks"):
        FaultyTier(capacity_blocks=0)
    with pytest.raises(ConfigError, match="medium"):
        FaultyTier(capacity_blocks=4, medium="CPU")
    with pytest.raises(ConfigError, match="unknown"):
        FaultyTier(capacity_blocks=4, io_timout=1.0)


async def test_a_tier_refuses_caches_without_a_dtype() -> None:
    from aiokvo import CanonicalKVCaches

    kv = KV()
    bare = CanonicalKVCaches(kv.caches.tensors, kv.caches.group_data_refs)  # dtype unknown
    with pytest.raises(ConfigError, match="dtype"):
        Offloader(kv.config(CPU_BLOCKS), bare, tiers=[faulty()])
    off = Offloader(kv.config(CPU_BLOCKS), bare, tiers=[faulty(dtype="bfloat16")])
    await off.aclose()


async def test_a_transfer_naming_a_group_the_layout_lacks_is_refused_before_any_io() -> None:
    import numpy as np

    from aiokvo import CPULoadStoreSpec
    from aiokvo.errors import TransferSpecError
    from aiokvo.tiers.spec import spec_class

    kv, tier = KV(), faulty()  # a layout of one KV group
    async with Offloader(kv.config(CPU_BLOCKS), kv.caches, tiers=[tier]) as off:
        medium = tier.store.medium
        for bad in ([key("g0"), key("g1", group=1)], [key("g0"), b"not a key"]):
            spec = spec_class(medium)(bad, [None, None])  # type: ignore[list-item]
            with pytest.raises(TransferSpecError):
                await off.worker.transfer_async(7, (CPULoadStoreSpec(np.arange(2)), spec))
        assert tier.statistics().writes == 0
        assert offloader_leaks(off) == []


def test_a_new_read_never_joins_a_stalled_slot_while_another_will_do() -> None:
    now = 100.0
    stuck = [now - STALLED_AFTER]  # its oldest transfer has run STALLED_AFTER seconds
    # Fewest transfers first, an idle slot before a busy one:
    assert pick_slot([[now - 0.01, now], [now - 0.01], []], now) == 2
    assert pick_slot([[now - 0.01, now], [now - 0.01]], now) == 1
    # A tie goes to the slot whose oldest transfer is youngest (the least likely stuck):
    assert pick_slot([[now - 0.2], [now - 0.1], [now - 0.3]], now) == 1
    # A stalled slot comes last, even when the others are busier:
    assert pick_slot([stuck, [now - 0.01, now, now]], now) == 1
    assert pick_slot([[now - 0.01, now], stuck, [now - 0.02, now]], now) == 0
    # Every slot stalled: the fewest transfers, then the youngest oldest one.
    assert pick_slot([[now - 9, now], [now - 5], [now - 7]], now) == 1
