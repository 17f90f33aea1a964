"""Faults inside coalesced runs and shared reads: every block gets its own outcome.

A bad region of the data file fails the calls that touch it (a write that
starts before it is written short up to it first, as a filling disk does):
the merged call fails, the blocks are redone one by one, and only the blocks
in the region fail; no block is served, committed or adopted unless its own
bytes were written and verified.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from aiokvo import CPULoadStoreSpec, TransferResult
from aiokvo.errors import TransferSpecError
from aiokvo.tiers import FileIO
from aiokvo.tiers.engine import StoreTier
from tests.tiers.disk._util import KV, STALL_DEADLINE, fill, is_disk_tier, keys, offloader

pytestmark = pytest.mark.usefixtures("aiokvo_leak_check")


def _size(buffers: Sequence[Any]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


def _head(buffers: Sequence[Any], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``buffers``."""
    out: list[memoryview] = []
    for b in buffers:
        view = memoryview(b).cast("B")
        if n <= 0:
            break
        out.append(view[:n])
        n -= view.nbytes
    return out


class BadRegionIO(FileIO):
    """Data-file calls touching ``[lo, hi)`` of ``bad_reads`` / ``bad_writes`` fail (EIO /
    ENOSPC); a write that starts before a bad region writes up to it, short."""

    def __init__(self) -> None:
        self.bad_reads: list[tuple[int, int]] = []
        self.bad_writes: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.read_calls: list[tuple[int, int]] = []

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        size = _size(buffers)
        with self.lock:
            self.read_calls.append((offset, size))
        for lo, hi in self.bad_reads:
            if offset < hi and lo < offset + size:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        size = _size(buffers)
        for lo, hi in self.bad_writes:
            if offset < hi and lo < offset + size:
                if offset < lo:
                    return super().pwritev(fd, _head(buffers, lo - offset), offset)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)


def _slots(tier: StoreTier, ks: Sequence[bytes]) -> list[int]:
    slots = [tier.index.slots.slot_of(k) for k in ks]  # type: ignore[arg-type]
    assert all(s is not None for s in slots)
    return slots  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("read_threads", "max_io_bytes"), [(1, None), (2, 512 << 10), (3, 256 << 10)]
)
async def test_eio_inside_coalesced_and_shared_reads_fails_those_blocks_alone(
    disk_tier_path: Path, read_threads: int, max_io_bytes: int | None
) -> None:
    kv = KV(page=64 << 10)  # 128 KiB blocks: 16 are a read worth sharing
    io = BadRegionIO()
    ks = keys("eio", 32)
    options: dict[str, Any] = {} if max_io_bytes is None else {"max_io_bytes": max_io_bytes}
    async with offloader(
        kv, disk_tier_path, cpu_blocks=16, file_io=io, max_write_blocks=16,
        read_threads=read_threads, failure_threshold=100, **options,
    ) as off:  # fmt: skip
        await fill(off, kv, ks[:16])
        await fill(off, kv, ks[16:], start=16)  # ks[:16] now on disk only
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        slot_bytes = kv.slot_bytes()
        bad = [5, 12]  # one in each share of two; a few bytes of each block
        for i in bad:
            at = _slots(tier, [ks[i]])[0] * slot_bytes + 7000
            io.bad_reads.append((at, at + 10))
        kv.clear(range(64))
        assert await off.load_prefix(ks[:16], list(range(40, 56))) == 5
        assert kv.holds(range(40, 45), ks[:5])
        assert any(size > slot_bytes for _, size in io.read_calls)  # runs were merged
        stats = off.statistics()
        assert stats.tiers[0].blocks_read == 14 and stats.tiers[0].read_failures == 2
        assert stats.tiers[0].blocks_read == 14 and stats.tiers[0].read_failures == 2
        assert stats.manager.pinned_blocks == 0 and stats.manager.writing_blocks == 0
        # Every good block after the bad ones was promoted, byte-exact.
        for lo, hi in ((6, 12), (13, 16)):
            io.read_calls.clear()
            kv.clear(range(64))
            gpu = list(range(40, 40 + hi - lo))
            assert await off.load_prefix(ks[lo:hi], gpu) == hi - lo
            assert kv.holds(gpu, ks[lo:hi]) and not io.read_calls  # from the CPU pool
        # An I/O error is not corruption: the blocks stay, and read once the disk heals.
        assert all(tier.index.holds(ks[i]) for i in bad)
        io.bad_reads.clear()
        kv.clear(range(64))
        assert await off.load_prefix([ks[5]], [40]) == 1 and kv.holds([40], [ks[5]])


@pytest.mark.parametrize("descending", [False, True])
async def test_a_write_cut_mid_run_commits_only_the_blocks_written_before_the_cut(
    disk_tier_path: Path, descending: bool
) -> None:
    kv = KV()
    io = BadRegionIO()
    old, ks = keys("old", 4), keys("cut", 4)
    slot_bytes = kv.slot_bytes()
    async with offloader(
        kv, disk_tier_path, cpu_blocks=4, slots=4, file_io=io, max_write_blocks=4,
        failure_threshold=100,
    ) as off:  # fmt: skip
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        if descending:  # slots freed together come back last-freed first: 3, 2, 1, 0
            await fill(off, kv, old)
        # The disk fails 1000 bytes into slot 2: the merged call is written short to there.
        io.bad_writes.append((2 * slot_bytes + 1000, 3 * slot_bytes))
        blocks = [8, 9, 10, 11]
        kv.write(blocks, ks)
        await off.store(ks, blocks)
        await off.drain()
        held = [k for k in ks if tier.index.holds(k)]
        # In transfer order, the first block that fails stops the store: ascending slots
        # 0, 1 commit; descending, only the block in slot 3 (slots 1, 0, written by the
        # merged call before it failed, are never committed).
        expect = ks[:1] if descending else ks[:2]
        assert held == expect
        if descending:
            assert _slots(tier, held) == [3]
        else:
            assert _slots(tier, held) == [0, 1]
        stats = off.statistics().tiers[0]
        assert stats.blocks_written == len(expect) + (4 if descending else 0)
        assert off.statistics().manager.pinned_blocks == 0
    io.bad_writes.clear()
    kv.clear(range(64))
    async with offloader(kv, disk_tier_path, cpu_blocks=4, slots=4) as off:  # a new process
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        assert [k for k in ks if tier.index.holds(k)] == expect
        assert off.statistics().tiers[0].adopted_blocks == len(expect)
        assert await off.load_prefix(ks, [30, 31, 32, 33]) == len(expect)
        assert kv.holds([30, 31][: len(expect)], expect)


async def test_a_load_cancelled_while_shares_are_read_leaks_nothing(
    disk_tier_path: Path,
) -> None:
    kv = KV(page=64 << 10)
    gate = threading.Event()
    gate.set()
    started = threading.Semaphore(0)

    class StallIO(FileIO):
        def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
            started.release()
            if not gate.wait(60):
                raise TimeoutError("the test never opened the gate")
            return super().preadv(fd, buffers, offset)

    ks = keys("cancel", 32)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=16, file_io=StallIO(), max_write_blocks=16,
        read_threads=2, max_io_bytes=512 << 10,  # two shares of two runs
    ) as off:  # fmt: skip
        await fill(off, kv, ks[:16])
        await fill(off, kv, ks[16:], start=16)
        gate.clear()
        load = asyncio.ensure_future(off.load_prefix(ks[:16], list(range(40, 56))))
        for _ in range(2):  # both shares are in their preadv
            while not started.acquire(blocking=False):
                await asyncio.sleep(0.001)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        assert off.statistics().manager.writing_blocks == 16  # the rows are still being read
        gate.set()
        await off.drain()
        stats = off.statistics()
        assert stats.manager.writing_blocks == 0 and stats.manager.pinned_blocks == 0
        assert stats.tiers[0].blocks_read == 16
        kv.clear(range(64))
        assert await off.load_prefix(ks[:16], list(range(40, 56))) == 16
        assert kv.holds(range(40, 56), ks[:16])


@pytest.mark.parametrize("seed", range(3))
async def test_random_eio_and_corruption_in_shared_runs_give_each_block_its_outcome(
    disk_tier_path: Path, seed: int
) -> None:
    import random

    from tests.tiers.disk._util import data_file

    rng = random.Random(seed)
    kv = KV(page=64 << 10)
    io = BadRegionIO()
    ks = keys(f"mix{seed}-", 32)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=16, file_io=io, max_write_blocks=16,
        read_threads=rng.choice([2, 3, 4]), max_io_bytes=rng.choice([1, 256 << 10, 1 << 20]),
        failure_threshold=100,
    ) as off:  # fmt: skip
        await fill(off, kv, ks[:16])
        await fill(off, kv, ks[16:], start=16)
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        slot_bytes = kv.slot_bytes()
        picked = rng.sample(range(16), 5)
        eio, corrupt = set(picked[:2]), set(picked[2:])
        for i in sorted(picked):
            payload = kv.caches.page_bytes_per_block
            at = _slots(tier, [ks[i]])[0] * slot_bytes + rng.randrange(payload)
            if i in eio:
                io.bad_reads.append((at, at + 1))
            else:
                with open(data_file(tier), "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ 0x80]))
        kv.clear(range(64))
        first = min(picked)
        assert await off.load_prefix(ks[:16], list(range(40, 56))) == first
        assert kv.holds(range(40, 40 + first), ks[:first])
        stats = off.statistics()
        assert stats.tiers[0].blocks_read == 11 and stats.tiers[0].checksum_failures == 3
        assert stats.manager.pinned_blocks == 0 and stats.manager.writing_blocks == 0
        io.read_calls.clear()
        for i in range(16):  # the good ones from the CPU pool; the rest are misses
            kv.clear(range(64))
            n = await off.load_prefix([ks[i]], [40])
            assert n == (i not in eio and i not in corrupt)
            assert not n or kv.holds([40], [ks[i]])
        assert all(tier.index.holds(ks[i]) for i in eio)
        assert not any(tier.index.holds(ks[i]) for i in corrupt)
        assert len(io.read_calls) == 2  # each EIO block tried again, one call each


async def test_a_share_stalled_past_the_deadline_holds_its_rows_until_it_returns(
    disk_tier_path: Path,
) -> None:
    kv = KV(page=64 << 10)
    gate = threading.Event()
    gate.set()
    stalled = threading.Event()
    slot_bytes = kv.slot_bytes()
    hold_from = [1 << 62]

    class StallIO(FileIO):  # the reads from slot 8 on (the second share) wait at the gate
        def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
            if offset >= hold_from[0]:
                stalled.set()
                if not gate.wait(60):
                    raise TimeoutError("the test never opened the gate")
            return super().preadv(fd, buffers, offset)

    ks = keys("late", 16)
    options: dict[str, Any] = {
        "cpu_blocks": 16, "max_write_blocks": 16, "read_threads": 2, "max_io_bytes": 512 << 10,
    }
    async with offloader(kv, disk_tier_path, **options) as off:  # see STALL_DEADLINE
        await fill(off, kv, ks)
    async with offloader(
        kv, disk_tier_path, file_io=StallIO(), io_timeout=STALL_DEADLINE,
        failure_threshold=100, **options,
    ) as off:  # fmt: skip
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        slots = sorted(_slots(tier, ks))
        hold_from[0] = slots[8] * slot_bytes
        gate.clear()
        kv.clear(range(64))
        assert await off.load_prefix(ks, list(range(40, 56))) == 0  # at the deadline
        assert stalled.is_set()
        stats = off.statistics()
        assert stats.promotion_timeouts == 1 and stats.tiers[0].timeouts == 1
        assert stats.manager.writing_blocks == 16  # every row stays reserved meanwhile
        assert not kv.layers[0].any()  # nothing reached the engine
        gate.set()
        await off.drain()
        stats = off.statistics()
        assert stats.manager.writing_blocks == 0 and stats.manager.pinned_blocks == 0
        # Every block comes back byte-exact: the late reads verified, blocks not started
        # before the deadline (TIMEOUT) kept on disk and read again.
        kv.clear(range(64))
        n = await off.load_prefix(ks, list(range(40, 56)))
        assert n == 16 and kv.holds(range(40, 56), ks)


async def test_merged_calls_that_move_a_few_bytes_at_a_time_still_move_every_byte(
    disk_tier_path: Path,
) -> None:
    kv = KV(page=6144)  # 12 KiB blocks fill their slots (runs), rows not pages (buffered)
    sizes: list[int] = []

    class PiecesIO(FileIO):  # every call moves at most 5000 bytes, mid-iovec
        def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
            sizes.append(_size(buffers))
            return super().pwritev(fd, _head(buffers, 5000), offset)

        def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
            sizes.append(_size(buffers))
            return super().preadv(fd, _head(buffers, 5000), offset)

    ks = keys("pieces", 16)
    async with offloader(
        kv, disk_tier_path, cpu_blocks=8, file_io=PiecesIO(), max_write_blocks=8,
        max_io_bytes=4 * kv.slot_bytes(),
    ) as off:  # fmt: skip
        assert kv.slot_bytes() == kv.caches.page_bytes_per_block
        await fill(off, kv, ks[:8])
        await fill(off, kv, ks[8:], start=8)  # ks[:8] now on disk only
        stats = off.statistics().tiers[0]
        assert not stats.direct_io and stats.blocks_written == 16
        assert max(sizes) == 4 * kv.slot_bytes()  # runs of four blocks, each call cut short
        kv.clear(range(64))
        assert await off.load_prefix(ks[:8], list(range(40, 48))) == 8
        assert kv.holds(range(40, 48), ks[:8])
        assert off.statistics().tiers[0].checksum_failures == 0


async def test_a_transfer_naming_one_cpu_block_twice_is_refused_before_any_io(
    disk_tier_path: Path,
) -> None:
    kv = KV()
    ks = keys("dup", 2)
    async with offloader(kv, disk_tier_path, cpu_blocks=8) as off:
        (tier,) = off.tiers
        store = tier.prepare_store(ks)
        assert store is not None
        with pytest.raises(TransferSpecError, match="names a CPU block twice"):
            await off.worker.transfer_async(9_000, (CPULoadStoreSpec([3, 3]), store.spec))
        tier.complete_store(store, TransferResult(9_000, False))
        assert tier.statistics().blocks_written == 0
        await fill(off, kv, ks)  # the tier is whole: the same keys store and load after it
        load = tier.prepare_load(ks)
        assert load is not None
        with pytest.raises(TransferSpecError, match="names a CPU block twice"):
            await off.worker.transfer_async(9_001, (load.spec, CPULoadStoreSpec([5, 5])))
        tier.complete_load(load, TransferResult(9_001, False))
        assert tier.statistics().blocks_read == 0


class _Dribble(FileIO):
    """Moves at most ``step`` bytes per call, as a filesystem writing in pieces may."""

    def __init__(self, step: int) -> None:
        self.step = step

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.pwritev(fd, _head(buffers, self.step), offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, _head(buffers, self.step), offset)


@pytest.mark.parametrize("kind", ["memoryview", "int16-rows"])
def test_short_calls_resume_in_bytes_whatever_the_buffers_item_size(
    tmp_path: Path, kind: str
) -> None:
    import numpy as np

    from aiokvo.tiers.disk.files import read_all, write_all

    rng = np.random.default_rng(3)
    rows = rng.integers(-(2**15), 2**15, size=(3, 500), dtype=np.int16)  # 1000 bytes a row
    buffers: list[Any] = [rows[0], rows[1], rows[2]]
    if kind == "memoryview":
        buffers = [memoryview(r.view(np.uint8)) for r in buffers]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        io = _Dribble(333)  # never on an item boundary of the int16 rows
        assert write_all(io, fd, buffers, 4096) == 3000
        back = np.zeros_like(rows)
        assert read_all(io, fd, [back[0], back[1], back[2]], 4096) == 3000
        assert np.array_equal(back, rows)
        assert os.pread(fd, 3000, 4096) == rows.tobytes()
    finally:
        os.close(fd)
