"""The holes a hostile or a careless local user found in the disk tier, each closed.

* another dtype's engine on the same root reads nothing (the fingerprint has the dtype);
* a root that is a symbolic link, or under a directory another uid can change, is
  refused; the directories the tier creates are owner-only whatever the umask;
* a read stuck in the kernel (a hung disk or NFS server) does not hang
  ``Offloader.aclose()``: it is abandoned within its deadline and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from aiokvo import CanonicalKVCaches, Offloader
from aiokvo.errors import UnsafeFileError
from tests.tiers.disk._util import KV, FaultyIO, disk_tier, fill, keys, offloader


class TypedKV(KV):
    """:class:`KV`'s blocks in a tensor of ``dtype`` (same bytes per page)."""

    def __init__(self, dtype: torch.dtype, num_blocks: int = 64) -> None:
        super().__init__(num_blocks)
        self.caches = CanonicalKVCaches.from_engine(
            [t.view(dtype) for t in self.layers]
        )


async def test_an_engine_of_another_dtype_reads_nothing_from_the_same_root(
    disk_tier_path: Path,
) -> None:
    ks = keys("dt", 4)
    bf16 = TypedKV(torch.bfloat16)
    async with offloader(bf16, disk_tier_path, cpu_blocks=8) as off:
        await fill(off, bf16, ks)
    fp16 = TypedKV(torch.float16)
    async with offloader(fp16, disk_tier_path, cpu_blocks=8) as off:
        assert await off.load_prefix(ks, [0, 1, 2, 3]) == 0
        (tier,) = off.tiers
        assert tier.fingerprint.dtype == "float16"
    again = TypedKV(torch.bfloat16)
    async with offloader(again, disk_tier_path, cpu_blocks=8) as off:
        assert await off.load_prefix(ks, [0, 1, 2, 3]) == 4  # its own dtype still reads them
        assert again.holds([0, 1, 2, 3], ks)


def test_a_root_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    kv = KV()
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        Offloader(kv.config(8), kv.caches, tiers=[disk_tier(link, kv=kv)])
    assert os.listdir(real) == []  # nothing was made through the link


def test_a_root_under_a_directory_others_can_change_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by everyone, no sticky bit: anyone could swap our root
    kv = KV()
    with pytest.raises(UnsafeFileError, match="writable by group or others"):
        Offloader(kv.config(8), kv.caches, tiers=[disk_tier(shared / "kv" / "cache", kv=kv)])
    assert not (shared / "kv").exists()


def test_directories_the_tier_creates_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "root"
    kv = KV()
    old = os.umask(0)
    try:
        off = Offloader(kv.config(8), kv.caches, tiers=[disk_tier(root, kv=kv)])
    finally:
        os.umask(old)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", root):
        st = os.lstat(directory)
        assert stat.S_IMODE(st.st_mode) == 0o700, directory
        assert st.st_uid == os.geteuid()
    asyncio.run(off.aclose())


async def test_a_stuck_disk_read_does_not_hang_close(disk_tier_path: Path) -> None:
    kv, io = KV(), FaultyIO()
    ks = keys("stuck", 4)
    off = offloader(kv, disk_tier_path, cpu_blocks=4, file_io=io, io_timeout=0.5)
    await off.open()
    await fill(off, kv, ks)
    await fill(off, kv, keys("other", 4), start=8)  # `ks` are on disk only now
    io.read_gate.clear()  # the next read hangs in the "kernel"
    assert await off.load_prefix(ks, [0, 1, 2, 3]) == 0  # the load gives up at the deadline
    start = time.monotonic()
    try:
        await asyncio.wait_for(off.aclose(), 60)  # a hang guard, far above the bound
        took = time.monotonic() - start
    finally:
        io.read_gate.set()  # let the stuck thread finish (and the store close behind it)
    (tier,) = off.tiers
    stats = tier.statistics()
    assert stats.abandoned == 1 and stats.timeouts == 1
    assert took < 30  # bounded by the deadlines, not by the stuck read


async def test_closing_a_tier_while_it_opens_leaks_no_slab(
    disk_tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiokvo.tiers.disk import slab

    entered, release = threading.Event(), threading.Event()
    real = slab.SlabDirectory.open_writer

    def slow_open(self: slab.SlabDirectory) -> slab.OpenedSlab:
        opened = real(self)  # the slab is taken (locked, files open) ...
        entered.set()
        release.wait(60)  # ... and the tier is closed before open() returns
        return opened

    monkeypatch.setattr(slab.SlabDirectory, "open_writer", slow_open)
    kv = KV()
    off = offloader(kv, disk_tier_path, cpu_blocks=4)
    opening = asyncio.ensure_future(off.open())
    assert await asyncio.to_thread(entered.wait, 60)
    closing = asyncio.ensure_future(off.aclose())
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.wait_for(closing, 60)
    with contextlib.suppress(Exception):  # it may end first, or see the close: either way
        await opening
    monkeypatch.undo()
    mine = str(disk_tier_path)
    assert not any(t.startswith(mine) for t in _open_files())  # every file of it closed
    async with offloader(kv, disk_tier_path, cpu_blocks=4) as again:  # slab 0 is free again
        await again.open()
        (tier,) = again.tiers
        assert tier.statistics().slab == 0  # type: ignore[attr-defined]


def _open_files() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, gone already
            continue
    return found


async def test_opening_reads_the_entries_written_not_the_whole_capacity(
    disk_tier_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = KV()
    slots = 1 << 20  # a 128 MiB index (an 8 GiB tier of 8 KiB blocks), sparse on disk
    ks = keys("few", 3)
    async with offloader(kv, disk_tier_path, cpu_blocks=4, slots=slots) as off:
        await fill(off, kv, ks)
    read = 0
    real_pread = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        nonlocal read
        data = real_pread(fd, n, offset)
        read += len(data)
        return data

    monkeypatch.setattr(os, "pread", counting)
    async with offloader(kv, disk_tier_path, cpu_blocks=4, slots=slots) as off:
        await off.open()
        (tier,) = off.tiers
        assert tier.statistics().adopted_blocks == 3  # type: ignore[attr-defined]
        kv.clear(range(3))
        assert await off.load_prefix(ks, [0, 1, 2]) == 3 and kv.holds([0, 1, 2], ks)
    assert read < 8 << 20, read  # the written extent, not 128 MiB of index
