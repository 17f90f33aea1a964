"""The disk tier's promises, through the Offloader (each test would catch its violation)."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from aiokvo import OffloadConfig, OffloadingEvent
from aiokvo.errors import ConfigError, UnsafeFileError
from aiokvo.events import EventSubscription
from aiokvo.keys import OffloadKey
from aiokvo.tiers import DiskTier, DiskTierConfig
from aiokvo.tiers.disk.format import ENTRY_BYTES, HEADER_PAGE
from aiokvo.tiers.disk.runs import IOV_MAX
from aiokvo.tiers.engine import StoreTier
from tests.tiers.disk._util import (
    KV,
    STALL_DEADLINE,
    FaultyIO,
    data_file,
    fill,
    is_disk_tier,
    keys,
    offloader,
)
from tests.tiers.mooncake._support import eventually


def drain_events(sub: EventSubscription) -> list[OffloadingEvent]:
    return [e for e in sub.drain_nowait() if isinstance(e, OffloadingEvent)]


@pytest.mark.parametrize("page", [4096, 64], ids=["aligned-direct", "unaligned-buffered"])
async def test_blocks_evicted_from_cpu_come_back_from_disk_byte_exact(
    disk_tier_path: Path, page: int
) -> None:
    kv = KV(page=page)
    ks = keys("a", 12)
    async with offloader(kv, disk_tier_path, cpu_blocks=8) as off:
        sub = off.subscribe()
        for i in range(0, 12, 4):  # the CPU pool holds 8: the first 4 leave it
            await fill(off, kv, ks[i : i + 4], start=i)
        tier = off.statistics().tiers[0]
        assert tier.blocks_written == 12 and tier.used_blocks == 12
        assert tier.direct_io is (page == 4096)
        events = drain_events(sub)
        disk_stored = [k for e in events if e.medium == "DISK" and not e.removed for k in e.keys]
        assert disk_stored == ks
        kv.clear(range(64))
        n = await off.load_prefix(ks[:8], list(range(20, 28)))
        assert n == 8
        assert kv.holds(range(20, 28), ks[:8])
        stats = off.statistics()
        assert stats.hits_by_medium["DISK"] == 4
        assert stats.hits_by_medium["CPU"] == 4
        assert stats.tiers[0].blocks_read == 4 and stats.tiers[0].reads == 1
        assert stats.manager.pinned_blocks == 0 and stats.manager.writing_blocks == 0
        # A prefix longer than the pool loads what fits next to it.
        kv.clear(range(64))
        n = await off.load_prefix(ks, list(range(30, 42)))
        assert n == 8 and kv.holds(range(30, 38), ks[:8])


async def test_a_flipped_byte_is_a_counted_evented_removed_miss(disk_tier_path: Path) -> None:
    kv = KV()
    ks = keys("c", 8)
    async with offloader(kv, disk_tier_path, cpu_blocks=4) as off:
        await fill(off, kv, ks[:4])
        await fill(off, kv, ks[4:], start=4)  # the first four now live on disk only
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        slot = tier.index.slots.slot_of(ks[2])
        assert slot is not None
        with open(data_file(tier), "r+b") as f:  # flip one byte of key 2's block
            f.seek(slot * kv.slot_bytes() + 1000)
            byte = f.read(1)
            f.seek(slot * kv.slot_bytes() + 1000)
            f.write(bytes([byte[0] ^ 0x40]))
        sub = off.subscribe()
        kv.clear(range(64))
        n = await off.load_prefix(ks, list(range(30, 38)))
        assert n == 2  # the prefix ends at the corrupt block: never its bytes
        assert kv.holds(range(30, 32), ks[:2])
        stats = off.statistics()
        assert stats.tiers[0].checksum_failures == 1
        assert stats.tiers[0].removals == 1
        assert not tier.index.holds(ks[2])
        removed = [e for e in drain_events(sub) if e.medium == "DISK" and e.removed]
        assert [e.keys for e in removed] == [[ks[2]]]
        assert stats.manager.writing_blocks == 0 and stats.manager.pinned_blocks == 0
        assert stats.tiers[0].read_failures == 1
    # Removed on disk too: a new process does not adopt it.
    async with offloader(kv, disk_tier_path, cpu_blocks=4) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        assert not tier.index.holds(ks[2])
        assert tier.index.holds(ks[3])


def _slots(tier: StoreTier, ks: list[OffloadKey]) -> list[int]:
    slots = [tier.index.slots.slot_of(k) for k in ks]
    assert all(s is not None for s in slots)
    return slots  # type: ignore[return-value]


@pytest.mark.parametrize("max_io_bytes", [None, 1], ids=["coalesced", "one-call-per-block"])
async def test_adjacent_slots_move_in_one_call_each_way(
    disk_tier_path: Path, max_io_bytes: int | None
) -> None:
    kv = KV()
    io = FaultyIO()
    ks = keys("run", 8)
    options = {} if max_io_bytes is None else {"max_io_bytes": max_io_bytes}
    calls = 1 if max_io_bytes is None else 4
    async with offloader(
        kv, disk_tier_path, cpu_blocks=4, file_io=io, max_write_blocks=4, **options
    ) as off:
        await fill(off, kv, ks[:4])
        assert io.writes == calls
        await fill(off, kv, ks[4:], start=4)  # ks[:4] now on disk only
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        first = _slots(tier, ks[:4])[0]
        assert _slots(tier, ks[:4]) == list(range(first, first + 4))
        kv.clear(range(64))
        reads = io.reads
        assert await off.load_prefix(ks[:4], [20, 21, 22, 23]) == 4
        assert kv.holds([20, 21, 22, 23], ks[:4])
        assert io.reads - reads == calls
        assert off.statistics().tiers[0].blocks_read == 4


async def test_slots_freed_together_come_back_descending_and_are_written_in_one_call(
    disk_tier_path: Path,
) -> None:
    kv = KV()
    io = FaultyIO()
    old, new = keys("old", 4), keys("new", 4)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=4, slots=4, file_io=io, max_write_blocks=4
    ) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        await fill(off, kv, old)
        writes = io.writes
        await fill(off, kv, new, start=4)  # evicts the old four from the tier's four slots
        assert not any(tier.index.holds(k) for k in old)
        slots = _slots(tier, new)
        assert slots == sorted(slots, reverse=True) == list(range(slots[0], slots[0] - 4, -1))
        assert io.writes - writes == 1  # one pwritev, its iovecs in file order
    kv.clear(range(64))
    async with offloader(kv, disk_tier_path, cpu_blocks=4, slots=4) as off:  # from disk
        assert await off.load_prefix(new, [30, 31, 32, 33]) == 4
        assert kv.holds([30, 31, 32, 33], new)  # each block landed in its own slot
        assert off.statistics().tiers[0].checksum_failures == 0


class EntryWritesIO(FaultyIO):
    """Counts the index's pwrites (entries cleared and committed)."""

    def __init__(self) -> None:
        super().__init__()
        self.entry_writes = 0

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        self.entry_writes += 1
        return super().pwrite(fd, data, offset)


@pytest.mark.parametrize("previous", [False, True], ids=["fresh-ascending", "reused-descending"])
async def test_the_index_entries_of_adjacent_slots_are_cleared_and_committed_in_one_call_each(
    disk_tier_path: Path, previous: bool
) -> None:
    kv = KV()
    io = EntryWritesIO()
    old, new = keys("eold", 4), keys("enew", 4)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=4, slots=4, file_io=io, max_write_blocks=4
    ) as off:
        if previous:
            await fill(off, kv, old)  # new then evicts these and reuses their slots
        before = io.entry_writes
        await fill(off, kv, new, start=4)
        assert io.entry_writes - before == 2  # one clear and one commit for the four
    kv.clear(range(64))
    async with offloader(kv, disk_tier_path, cpu_blocks=4, slots=4) as off:  # entries on disk
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        assert tier.statistics().adopted_blocks == 4
        assert await off.load_prefix(new, [30, 31, 32, 33]) == 4
        assert kv.holds([30, 31, 32, 33], new)
        assert off.statistics().tiers[0].checksum_failures == 0


async def test_a_data_file_cut_mid_run_serves_the_blocks_before_the_cut(
    disk_tier_path: Path,
) -> None:
    kv = KV()
    ks = keys("cut", 8)
    async with offloader(kv, disk_tier_path, cpu_blocks=4, max_write_blocks=4) as off:
        await fill(off, kv, ks[:4])
        await fill(off, kv, ks[4:], start=4)  # ks[:4] now on disk only, in adjacent slots
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        slots = _slots(tier, ks[:4])
        assert slots == list(range(slots[0], slots[0] + 4))
        os.truncate(data_file(tier), slots[2] * kv.slot_bytes())  # the file ends before key 2
        kv.clear(range(64))
        assert await off.load_prefix(ks, list(range(30, 38))) == 2
        assert kv.holds([30, 31], ks[:2])
        stats = off.statistics().tiers[0]
        assert stats.read_failures == 2 and stats.checksum_failures == 0
        assert tier.index.holds(ks[0]) and tier.index.holds(ks[1])
        assert not tier.index.holds(ks[2]) and not tier.index.holds(ks[3])


@pytest.mark.parametrize("read_threads", [1, 3])
async def test_a_big_promotion_read_by_several_threads_verifies_every_block(
    disk_tier_path: Path, read_threads: int
) -> None:
    kv = KV(page=64 << 10)  # 128 KiB blocks: 16 of them are a read worth sharing
    io = FaultyIO()
    ks = keys("wide", 32)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=16, file_io=io, max_write_blocks=16,
        read_threads=read_threads, max_io_bytes=1,  # one call per block: 16 runs
    ) as off:  # fmt: skip
        await fill(off, kv, ks[:16])
        await fill(off, kv, ks[16:], start=16)  # ks[:16] now on disk only
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        slot = tier.index.slots.slot_of(ks[12])
        assert slot is not None
        with open(data_file(tier), "r+b") as f:  # flip one byte of key 12's block
            f.seek(slot * kv.slot_bytes() + 5000)
            byte = f.read(1)
            f.seek(slot * kv.slot_bytes() + 5000)
            f.write(bytes([byte[0] ^ 0x01]))
        kv.clear(range(64))
        reads, io.reader_threads = io.reads, set()
        # Each share on its own thread, all at once (a pool thread that finished one
        # share could otherwise take the next on a loaded machine).
        io.rendezvous = threading.Barrier(read_threads, timeout=60)
        assert await off.load_prefix(ks[:16], list(range(40, 56))) == 12
        io.rendezvous = None
        assert kv.holds(range(40, 52), ks[:12])
        assert io.reads - reads == 16  # every block was read (and all but one verified good)
        assert len(io.reader_threads) == read_threads
        stats = off.statistics().tiers[0]
        assert stats.checksum_failures == 1 and stats.blocks_read == 15
        assert not tier.index.holds(ks[12]) and tier.index.holds(ks[13])
        assert off.statistics().manager.pinned_blocks == 0


async def test_a_stalled_share_of_one_read_holds_up_no_other_reads_share(
    disk_tier_path: Path,
) -> None:
    # A big promotion is read in read_threads shares, the later ones on helper threads.
    # Each read lane has helpers of its own, so one request's share that hangs (a bad
    # sector, a stuck device queue) holds up that request only (bench_agentic --stall
    # found another request's prefetch past its deadline behind a shared helper).
    kv = KV(num_blocks=96, page=64 << 10)  # 128 KiB blocks: 16 are two 1 MiB shares
    io = FaultyIO()
    slow, fast = keys("slow", 16), keys("fast", 16)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=48, slots=96, file_io=io, max_write_blocks=48,
        read_threads=2, max_io_bytes=1 << 20, io_timeout=120,
    ) as off:  # fmt: skip
        await fill(off, kv, slow)
        await fill(off, kv, fast, start=16)
        await fill(off, kv, keys("push", 48), start=32)  # both on disk only now
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        slots = sorted(s for k in slow if (s := tier.index.slots.slot_of(k)) is not None)
        assert len(slots) == 16
        size = kv.slot_bytes()
        io.hold = [(s * size, (s + 1) * size) for s in slots[8:]]  # its second share
        stuck = asyncio.ensure_future(off.prefetch(slow, deadline=None))
        try:
            await asyncio.to_thread(io.held.wait, 30)
            assert io.held.is_set() and "read-io" in io.held_by  # a helper thread hangs
            assert await off.prefetch(fast, deadline=20) == 16  # its shares are not behind it
            assert not stuck.done()
        finally:
            io.hold_gate.set()  # a failure above ends now, not when the gate times out
        assert await stuck == 16
        control = off.statistics().control
        assert (control.prefetches_completed, control.prefetches_late) == (2, 0)


async def test_another_layout_or_model_never_reads_the_blocks(disk_tier_path: Path) -> None:
    kv = KV()
    ks = keys("f", 4)
    async with offloader(kv, disk_tier_path) as off:
        await fill(off, kv, ks)
        ours = off.tiers[0]
        assert is_disk_tier(ours)
        our_dir = ours.store.directory
    async with offloader(kv, disk_tier_path, model_id="another-model") as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        assert tier.store.directory != our_dir
        assert await off.load_prefix(ks, [10, 11, 12, 13]) == 0
        other_dir = tier.store.directory
    # Our slab copied under the other model's name: its header names our layout.
    for name in os.listdir(our_dir):
        shutil.copy(our_dir / name, other_dir / name.replace("0000", "0001"))
        os.chmod(other_dir / name.replace("0000", "0001"), 0o600)
    async with offloader(kv, disk_tier_path, model_id="another-model") as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        assert await off.load_prefix(ks, [10, 11, 12, 13]) == 0
        assert tier.statistics().refused_slabs >= 1


async def test_an_engine_of_another_dtype_never_reads_the_blocks(disk_tier_path: Path) -> None:
    """The same bytes per page as bfloat16 or int8 are other numbers: the dtype is part
    of the layout, from ``from_engine``; caches built without one need the tier's."""
    import torch

    from aiokvo import CanonicalKVCaches

    kv = KV()
    ks = keys("dt", 4)
    async with offloader(kv, disk_tier_path) as off:
        await fill(off, kv, ks)
    assert kv.caches.dtype == "int8"
    half = KV()
    half.caches = CanonicalKVCaches.from_engine([t.view(torch.bfloat16) for t in half.layers])
    assert half.caches.dtype == "bfloat16"
    assert half.caches.page_bytes_per_block == kv.caches.page_bytes_per_block
    async with offloader(half, disk_tier_path) as off:
        assert await off.load_prefix(ks, [10, 11, 12, 13]) == 0
    bare = KV()  # kv's tensors, by hand: no dtype
    bare.caches = CanonicalKVCaches(kv.caches.tensors, kv.caches.group_data_refs)
    with pytest.raises(ConfigError, match="dtype"):
        offloader(bare, disk_tier_path)
    kv.clear(range(64))
    async with offloader(bare, disk_tier_path, dtype="int8") as off:  # the tier says it
        assert await off.load_prefix(ks, [10, 11, 12, 13]) == 4
        assert kv.holds([10, 11, 12, 13], ks)


async def test_capacity_is_honoured_exactly_and_eviction_is_evented(disk_tier_path: Path) -> None:
    kv = KV()
    ks = keys("cap", 30)
    async with offloader(kv, disk_tier_path, cpu_blocks=4, slots=10) as off:
        sub = off.subscribe()
        for i in range(0, 30, 3):
            await fill(off, kv, ks[i : i + 3], start=i)
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        stats = tier.statistics()
        assert stats.capacity_blocks == 10 and stats.used_blocks == 10
        assert stats.evictions == 20
        directory = tier.store.directory
        on_disk = sum(os.stat(directory / n).st_size for n in os.listdir(directory))
        assert on_disk <= tier.store.config.capacity_bytes
        events = drain_events(sub)
        gone = [k for e in events if e.medium == "DISK" and e.removed for k in e.keys]
        assert sorted(gone) == sorted(ks[:20])  # LRU: the oldest went
        assert all(tier.index.holds(k) for k in ks[20:])


async def test_enospc_fails_the_store_cleanly_and_shrinks_nothing(disk_tier_path: Path) -> None:
    kv = KV()
    io = FaultyIO()
    ks = keys("full", 8)
    async with offloader(kv, disk_tier_path, cpu_blocks=8, file_io=io) as off:
        await fill(off, kv, ks[:4])
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        assert tier.statistics().used_blocks == 4
        io.fail_after_bytes = io.written + kv.caches.page_bytes_per_block  # room for one more
        kv.write([4, 5, 6, 7], ks[4:])
        result = await off.store(ks[4:], [4, 5, 6, 7])
        await off.drain()
        assert result.stored == tuple(ks[4:])  # the CPU pool took them: the tier is extra
        stats = tier.statistics()
        assert stats.blocks_written == 5 and stats.write_failures == 3
        assert stats.used_blocks == 5 and stats.evictions == 0  # nothing else went
        assert all(tier.index.holds(k) for k in ks[:5])
        assert not any(tier.index.holds(k) for k in ks[5:])
    io.fail_after_bytes = None
    async with offloader(kv, disk_tier_path, cpu_blocks=8) as off:  # all five survive
        kv.clear(range(64))
        assert await off.load_prefix(ks[:5], [20, 21, 22, 23, 24]) == 5
        assert kv.holds([20, 21, 22, 23, 24], ks[:5])


async def test_a_new_process_rebuilds_the_index_and_serves_the_blocks(
    disk_tier_path: Path,
) -> None:
    kv = KV()
    ks = keys("r", 6)
    async with offloader(kv, disk_tier_path) as off:
        await fill(off, kv, ks)
    kv.clear(range(64))
    async with offloader(kv, disk_tier_path) as off:
        stats = off.statistics().tiers[0]
        assert stats.adopted_blocks == 6
        sub = off.subscribe()
        assert await off.load_prefix(ks, list(range(40, 46))) == 6
        assert kv.holds(range(40, 46), ks)
        assert off.statistics().hits_by_medium["DISK"] == 6
        assert drain_events(sub)  # promoted into the CPU pool: CPU stores


async def test_a_failing_disk_is_taken_out_and_tried_again_later(disk_tier_path: Path) -> None:
    kv = KV()
    io = FaultyIO()
    now = [0.0]
    ks = keys("b", 8)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=4, file_io=io, clock=lambda: now[0],
        failure_threshold=2, reset_after=10.0,
    ) as off:  # fmt: skip
        await fill(off, kv, ks[:4])
        await fill(off, kv, ks[4:], start=4)  # ks[:4] on disk only, ks[4:] in the CPU pool
        io.fail_reads = errno.EIO
        for _ in range(2):
            assert await off.load_prefix(ks, list(range(20, 28))) == 0
        tier = off.statistics().tiers[0]
        assert tier.breaker.state == "open" and tier.breaker.trips == 1
        reads, writes = io.reads, io.writes
        # Out of the path: no disk I/O, and the CPU pool goes on serving.
        fresh = keys("fresh", 4)
        await fill(off, kv, fresh, start=40)
        assert await off.load_prefix(fresh, [30, 31, 32, 33]) == 4
        assert kv.holds([30, 31, 32, 33], fresh)
        assert await off.load_prefix(ks, list(range(20, 28))) == 0
        assert (io.reads, io.writes) == (reads, writes)
        assert off.statistics().tiers[0].lookups_bypassed >= 1
        # Later, one trial: the disk works again and the tier is back.
        io.fail_reads = None
        now[0] += 10.0
        kv.clear(range(64))
        assert await off.load_prefix(ks, list(range(20, 28))) == 4  # all the pool holds
        assert kv.holds(range(20, 24), ks[:4])
        assert off.statistics().tiers[0].breaker.state == "closed"


async def test_a_stalled_disk_times_out_while_the_cpu_pool_serves(disk_tier_path: Path) -> None:
    kv = KV()
    ks = keys("s", 8)
    async with offloader(kv, disk_tier_path, cpu_blocks=8) as off:  # see STALL_DEADLINE
        await fill(off, kv, ks[:4])
    io = FaultyIO()
    async with offloader(  # admit_after=2: this one writes nothing
        kv, disk_tier_path, cpu_blocks=8, file_io=io, io_timeout=STALL_DEADLINE,
        failure_threshold=1, admit_after=2,
    ) as off:  # fmt: skip
        await fill(off, kv, ks[4:], start=4)  # ks[:4] on disk only, ks[4:] in the pool
        assert off.statistics().tiers[0].blocks_written == 0
        io.read_gate.clear()  # the disk stalls
        # The promotion hangs on the disk; the load returns what the pool has at the deadline.
        n = await asyncio.wait_for(off.load_prefix(ks, list(range(20, 28))), 60)
        assert n == 0 and io.reads == 0 and io.stalled_reads == 1
        stats = off.statistics()
        assert stats.promotion_timeouts == 1
        assert stats.tiers[0].timeouts == 1 and stats.tiers[0].breaker.state == "open"
        assert await off.load_prefix(ks[4:], [30, 31, 32, 33]) == 4  # the pool serves
        assert kv.holds([30, 31, 32, 33], ks[4:])
        io.read_gate.set()
        await off.drain()
        assert off.statistics().manager.writing_blocks == 0


async def test_admit_after_two_writes_a_block_on_its_second_offer(disk_tier_path: Path) -> None:
    kv = KV()
    ks = keys("adm", 4)
    async with offloader(kv, disk_tier_path, cpu_blocks=8, admit_after=2) as off:
        await fill(off, kv, ks)
        assert off.statistics().tiers[0].blocks_written == 0
        result = await off.store(ks, [0, 1, 2, 3])  # held by the pool: skipped, offered again
        assert result.skipped == tuple(ks)
        await off.drain()
        assert off.statistics().tiers[0].blocks_written == 4


async def test_fsync_commit_syncs_data_then_entries(disk_tier_path: Path) -> None:
    kv = KV()
    ks = keys("fs", 3)
    for policy, expected in (("none", 0), ("commit", 3)):
        io = FaultyIO()
        root = disk_tier_path / policy
        root.mkdir(mode=0o700)
        async with offloader(kv, root, fsync=policy, file_io=io) as off:
            await fill(off, kv, ks)
            assert off.statistics().tiers[0].blocks_written == 3
        assert io.syncs == expected  # entries cleared, payload, entries committed


async def test_aclose_finishes_tier_writes_in_flight(disk_tier_path: Path) -> None:
    kv = KV()
    io = FaultyIO()
    ks = keys("w", 4)
    off = offloader(kv, disk_tier_path, file_io=io)
    await off.open()
    io.write_gate.clear()
    kv.write([0, 1, 2, 3], ks)
    assert (await off.store(ks, [0, 1, 2, 3])).ok  # CPU done; the disk write is held
    (to_disk,) = [h for h in off.statistics().worker.handlers
                  if h.transfer_type == ("CPU", "DISK")]  # fmt: skip
    assert to_disk.in_flight == 1
    closing = asyncio.ensure_future(off.aclose())
    await asyncio.sleep(0.01)
    assert not closing.done()
    io.write_gate.set()
    await closing
    async with offloader(kv, disk_tier_path) as again:
        assert again.statistics().tiers[0].adopted_blocks == 4


async def test_two_offloaders_share_one_directory(disk_tier_path: Path) -> None:
    kv_a, kv_b = KV(), KV()
    ks = keys("sh", 4)
    async with offloader(kv_a, disk_tier_path) as a, offloader(kv_b, disk_tier_path) as b:
        ta, tb = a.tiers[0], b.tiers[0]
        assert is_disk_tier(ta) and is_disk_tier(tb)
        assert ta.index.slab != tb.index.slab  # one writer per slab
        await fill(a, kv_a, ks)
        assert await b.load_prefix(ks, [10, 11, 12, 13]) == 0  # before b's refresh
        await tb.maintain()
        assert await b.load_prefix(ks, [10, 11, 12, 13]) == 4
        assert kv_b.holds([10, 11, 12, 13], ks)
        # Both write the same key: neither copy is corrupted, each reads back exact.
        await fill(b, kv_b, keys("both", 2), start=20)
        await fill(a, kv_a, keys("both", 2), start=20)
        await ta.maintain()
        assert ta.index.holds(keys("both", 1)[0]) and tb.index.holds(keys("both", 1)[0])
    async with offloader(kv_a, disk_tier_path) as c:
        tier = c.tiers[0]
        assert is_disk_tier(tier)
        kv_a.clear(range(64))
        both = keys("both", 2)
        assert await c.load_prefix(both, [40, 41]) == 2
        assert kv_a.holds([40, 41], both)


async def test_a_replaced_foreign_block_is_a_stale_miss(disk_tier_path: Path) -> None:
    kv_a, kv_b = KV(), KV()
    old, new = keys("old", 2), keys("new", 2)
    async with offloader(kv_a, disk_tier_path, slots=2) as a, offloader(kv_b, disk_tier_path) as b:
        tb = b.tiers[0]
        assert is_disk_tier(tb)
        await fill(a, kv_a, old)
        await tb.maintain()
        await fill(a, kv_a, new, start=2)  # a's two slots now hold other blocks
        kv_b.clear(range(64))
        assert await b.load_prefix(old, [10, 11]) == 0
        stats = tb.statistics()
        assert stats.stale_reads == 2 and stats.checksum_failures == 0
        assert stats.foreign_blocks == 0


async def test_settings_from_dict_build_the_disk_tier(disk_tier_path: Path) -> None:
    kv = KV()
    config = OffloadConfig.from_dict(
        {
            "cpu_bytes_to_use": 8 * kv.caches.page_bytes_per_block,
            "tiers": [{"kind": "disk", "root": str(disk_tier_path), "capacity_bytes": "1048576",
                       "model_id": "m", "admit_after": 1, "fsync": "commit"}],
        },
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.caches.page_bytes_per_block,
    )  # fmt: skip
    assert config.tiers == (
        DiskTierConfig(root=str(disk_tier_path), capacity_bytes=1 << 20, model_id="m",
                       fsync="commit"),
    )  # fmt: skip
    from aiokvo import Offloader

    ks = keys("dict", 2)
    async with Offloader(config, kv.caches) as off:
        assert [t.medium for t in off.tiers] == ["DISK"]
        await fill(off, kv, ks)
        assert off.statistics().tiers[0].blocks_written == 2


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"fsync": "always"}, "fsync"),
        ({"admit_after": 0}, "admit_after"),
        ({"io_timeout": -1}, "io_timeout"),
        ({"model_id": ""}, "model_id"),
        ({"direct_io": "yes"}, "direct_io"),
        ({"max_io_bytes": 0}, "max_io_bytes"),
        ({"read_threads": 0}, "read_threads"),
        ({"read_threads": 1.5}, "read_threads"),
    ],
)
def test_bad_settings_are_typed_errors(disk_tier_path: Path, options: dict, match: str) -> None:
    settings = {"capacity_bytes": 1 << 20, "model_id": "m", **options}
    with pytest.raises(ConfigError, match=match):
        DiskTier(disk_tier_path, **settings)


def test_a_capacity_below_one_block_is_refused_at_bind(disk_tier_path: Path) -> None:
    kv = KV()
    with pytest.raises(ConfigError, match="holds no block"):
        offloader(kv, disk_tier_path, capacity_bytes=HEADER_PAGE + ENTRY_BYTES)


def test_a_block_of_more_tensors_than_one_call_takes_is_refused_at_bind(
    disk_tier_path: Path,
) -> None:
    kv = KV(2, page=64, layers=IOV_MAX + 1)
    with pytest.raises(ConfigError, match=f"{IOV_MAX + 1} tensors needs {IOV_MAX + 1} iovecs"):
        offloader(kv, disk_tier_path, cpu_blocks=1)


def test_a_root_open_to_others_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeFileError, match="sticky"):
        offloader(KV(), root)


def test_a_symlinked_root_or_a_root_under_a_directory_others_control_is_refused(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        offloader(KV(), tmp_path / "link")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeFileError, match="sticky"):
        offloader(KV(), shared / "deeper" / "root")
    assert not (shared / "deeper").exists()  # nothing made under it


def test_the_roots_missing_parents_are_made_owner_only(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "root"
    old = os.umask(0)  # makedirs would leave the parents 0777
    try:
        offloader(KV(), root)
    finally:
        os.umask(old)
    for made in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700, made


async def test_a_symlinked_slab_file_is_refused(disk_tier_path: Path, tmp_path: Path) -> None:
    kv = KV()
    async with offloader(kv, disk_tier_path) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        directory = tier.store.directory
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 8192)
    (directory / "slab-0000.index").unlink()
    (directory / "slab-0000.index").symlink_to(target)
    async with offloader(kv, disk_tier_path) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        assert tier.index.slab == 1  # the link was left alone, a new slab made
        assert tier.statistics().refused_slabs >= 1
    assert target.read_bytes() == b"x" * 8192


async def test_a_key_found_twice_at_open_is_adopted_once_and_the_older_slot_freed(
    disk_tier_path: Path,
) -> None:
    """A slab can hold two entries of one key (a process killed between committing a
    block's new slot and freeing its old one): the newest is adopted, the other dropped
    and its slot freed, and only the blocks kept count as adopted."""
    from aiokvo.tiers.disk.format import entry_offset, pack_entry, unpack_entry

    kv = KV()
    ks = keys("twice", 3)
    async with offloader(kv, disk_tier_path) as off:
        await fill(off, kv, ks)
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        index_file = tier.store.directory / "slab-0000.index"
        where = tier.index.location(ks[2])
        assert where is not None and where.generation > 1
        free = next(s for s in range(tier.index.num_slots) if s not in _slots(tier, ks))
    fd = os.open(index_file, os.O_RDWR)
    try:  # an older entry of ks[2], in a free slot
        payload = kv.caches.page_bytes_per_block
        stale = pack_entry(ks[2], where.checksum ^ 1, where.generation - 1, payload)
        os.pwrite(fd, stale, entry_offset(free))
    finally:
        os.close(fd)
    async with offloader(kv, disk_tier_path) as again:
        stats = again.statistics().tiers[0]
        assert stats.adopted_blocks == 3 and stats.used_blocks == 3
        kv.clear(range(64))
        assert await again.load_prefix(ks, [20, 21, 22]) == 3
        assert kv.holds([20, 21, 22], ks)
        await again.drain()
    with open(index_file, "rb") as f:  # the dropped entry's slot was freed on disk
        f.seek(entry_offset(free))
        assert unpack_entry(f.read(128)) is None


async def test_closing_a_tier_while_it_opens_leaves_no_slab_taken(
    disk_tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slab the store's open takes once the close began is closed too (else its
    files stay open and its writer lock held: the next tier here takes another slab)."""
    import threading

    from aiokvo.tiers.disk.store import DiskStore

    entered, gate = threading.Event(), threading.Event()
    real_open = DiskStore.open

    def stalled_open(self: DiskStore) -> object:
        entered.set()
        assert gate.wait(30), "the test never let the open go on"
        return real_open(self)

    kv = KV()
    off = offloader(kv, disk_tier_path)
    tier = off.tiers[0]
    assert is_disk_tier(tier)
    monkeypatch.setattr(DiskStore, "open", stalled_open)
    opening = asyncio.ensure_future(tier.open())
    await eventually(entered.is_set, "the store's open")
    closing = asyncio.ensure_future(tier.aclose())
    await asyncio.sleep(0.05)
    gate.set()  # the open takes its slab now, after the close began
    await closing
    await asyncio.gather(opening, return_exceptions=True)
    await off.aclose()
    monkeypatch.setattr(DiskStore, "open", real_open)
    async with offloader(kv, disk_tier_path) as again:
        other = again.tiers[0]
        assert is_disk_tier(other)
        assert other.index.slab == 0  # slab 0 was released


def _open_fds(name: str) -> int:
    """This process's open file descriptors on files named ``name``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name
        except OSError:
            continue  # closed meanwhile (the listing's own fd)
    return n


@pytest.mark.parametrize("periodic", [False, True], ids=["maintain", "periodic"])
async def test_closing_a_tier_during_a_refresh_closes_the_slabs_the_refresh_opened(
    disk_tier_path: Path, monkeypatch: pytest.MonkeyPatch, periodic: bool
) -> None:
    import threading

    from aiokvo.tiers.disk.slab import SlabDirectory

    entered, gate = threading.Event(), threading.Event()

    kv_a, kv_b = KV(), KV()
    b = offloader(kv_b, disk_tier_path, refresh_interval=0.05 if periodic else 0)
    await b.open()  # slab 0; its first refresh finds no other slab
    tb = b.tiers[0]
    assert is_disk_tier(tb) and tb.index.slab == 0
    directory = tb.store._directory  # b's alone: a's refreshes go on
    assert isinstance(directory, SlabDirectory)
    real_refresh = directory.refresh

    def stalled_refresh(*args: Any) -> Any:
        entered.set()
        assert gate.wait(30), "the test never let the refresh go on"
        return real_refresh(*args)

    monkeypatch.setattr(directory, "refresh", stalled_refresh)
    async with offloader(kv_a, disk_tier_path) as a:
        await fill(a, kv_a, keys("r", 2))  # slab 1, new to b
        held_by_a = _open_fds("slab-0001.data")
        refreshing = asyncio.ensure_future(asyncio.sleep(0) if periodic else tb.maintain())
        await eventually(entered.is_set, "the refresh")
        closing = asyncio.ensure_future(b.aclose())
        await asyncio.sleep(0.05)
        gate.set()  # the refresh opens a's slab now, after the close began
        await closing
        await asyncio.gather(refreshing, return_exceptions=True)
        assert _open_fds("slab-0001.data") == held_by_a  # b holds none of slab 1's files
