"""SharedOffloadRegion on a real /dev/shm: sharing across processes, stale files,
waits and timeouts, views, pre-faulting, pinning hooks and cleanup."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import mmap
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aiokvo.errors import (
    ConfigError,
    SharedRegionError,
    SharedRegionLayoutError,
    SharedRegionTimeoutError,
    UnsafeFileError,
    UnsafeSharedRegionError,
)
from aiokvo.memory import shared_region
from aiokvo.memory.ownership import FileState, OwnerHeader, OwnerIdentity
from aiokvo.memory.shared_region import REGION_MAGIC, SharedOffloadRegion, default_directory

SHM = default_directory()
REPO = Path(__file__).resolve().parents[2]
PAGE = mmap.ALLOCATIONGRANULARITY

# Closing a region while a view is alive only warns; here every test but the one
# about that case must close cleanly.
pytestmark = pytest.mark.filterwarnings("error::ResourceWarning")


@pytest.fixture
def iid() -> Iterator[str]:
    """A unique instance id; whatever files it names are removed afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    for suffix in (".mmap", ".lock"):
        (SHM / f"aiokvo_offload_{name}{suffix}").unlink(missing_ok=True)


def region(iid: str, **overrides: Any) -> SharedOffloadRegion:
    kwargs: dict[str, Any] = {
        "num_blocks": 8,
        "num_workers": 2,
        "page_bytes_per_rank": PAGE,
        "rank": 0,
        "timeout": 10.0,
    }
    kwargs.update(overrides)
    return SharedOffloadRegion(iid, **kwargs)


def paths(iid: str) -> tuple[Path, Path]:
    return SHM / f"aiokvo_offload_{iid}.mmap", SHM / f"aiokvo_offload_{iid}.lock"


def read_header(path: Path) -> OwnerHeader:
    header = OwnerHeader.unpack(path.read_bytes()[:PAGE], magic=REGION_MAGIC)
    assert header is not None
    return header


def forge_header(path: Path, **changes: Any) -> None:
    """Rewrite the header: ``owner_*`` changes go to its owner, the rest to the header."""
    header = read_header(path)
    owner = {k.removeprefix("owner_"): v for k, v in changes.items() if k.startswith("owner_")}
    rest = {k: v for k, v in changes.items() if not k.startswith("owner_")}
    forged = dataclasses.replace(header, owner=dataclasses.replace(header.owner, **owner), **rest)
    fd = os.open(path, os.O_RDWR)
    try:
        forged.write(fd)
    finally:
        os.close(fd)


def mapping_rss_bytes(path: Path) -> int:
    """Resident bytes of this process's mapping(s) of ``path``, from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            inside = str(path) in line
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def pattern(rank: int, layer: int, block: int) -> int:
    return (rank * 50 + layer * 20 + block) % 127


# ----------------------------------------------------------------- two processes

CREATOR_CHILD = textwrap.dedent(
    """
    import json, sys
    from aiokvo.memory.shared_region import SharedOffloadRegion
    iid, nb, pbr, l0, l1 = sys.argv[1], *map(int, sys.argv[2:6])
    r = SharedOffloadRegion(iid, num_blocks=nb, num_workers=2, page_bytes_per_rank=pbr,
                            rank=0, timeout=20)
    for layer, view in enumerate((r.create_next_view(l0), r.create_next_view(l1))):
        for b in range(nb):
            view[b].fill_((0 * 50 + layer * 20 + b) % 127)
    print(json.dumps({"creator": r.is_creator, "generation": r.generation}), flush=True)
    sys.stdin.readline()  # the peer has written its half
    rows = r.rows()
    seen = [[sorted(set(rows[b, pbr:pbr + l0].tolist())),
             sorted(set(rows[b, pbr + l0:pbr + l0 + l1].tolist()))] for b in range(nb)]
    print(json.dumps(seen), flush=True)
    sys.stdin.readline()  # hold the region until killed
    """
)


def wait_until_reaped_or_zombie(pid: int) -> None:
    for _ in range(2000):
        identity = OwnerIdentity.of_process(pid)
        if identity is None or not identity.is_alive():
            return
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} did not die")


@pytest.mark.system
def test_two_processes_share_interleaved_rows_then_killed_creator_is_replaced(iid: str) -> None:
    nb, pbr, l0, l1 = 6, 3000, 1000, 1500  # page-unaligned on purpose
    mmap_path, lock_path = paths(iid)
    argv = [sys.executable, "-c", CREATOR_CHILD, iid, str(nb), str(pbr), str(l0), str(l1)]
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            hello = json.loads(child.stdout.readline())
            assert hello == {"creator": True, "generation": 1}

            peer = region(iid, num_blocks=nb, page_bytes_per_rank=pbr, rank=1)
            assert not peer.is_creator and peer.generation == 1
            k, v = peer.create_next_view(l0), peer.create_next_view(l1)
            assert k.stride() == v.stride() == (2 * pbr, 1)
            assert (k.storage_offset(), v.storage_offset()) == (pbr, pbr + l0)
            for layer, view in enumerate((k, v)):
                for b in range(nb):
                    view[b].fill_(pattern(1, layer, b))
            rows = peer.rows()
            for b in range(nb):  # the creator's pages, at rank 0's offsets in each row
                assert set(rows[b, :l0].tolist()) == {pattern(0, 0, b)}
                assert set(rows[b, l0 : l0 + l1].tolist()) == {pattern(0, 1, b)}
                assert set(rows[b, l0 + l1 : pbr].tolist()) == {0}  # unused tail of the slice

            child.stdin.write("written\n")
            child.stdin.flush()
            seen = json.loads(child.stdout.readline())
            assert seen == [[[pattern(1, 0, b)], [pattern(1, 1, b)]] for b in range(nb)]

            del k, v, rows, view
            peer.close()
            assert mmap_path.exists(), "a rank that did not create the file must not remove it"

            os.kill(child.pid, signal.SIGKILL)
            wait_until_reaped_or_zombie(child.pid)  # a zombie counts as dead
            with region(iid, num_blocks=nb, page_bytes_per_rank=pbr, rank=1) as fresh:
                assert fresh.is_creator and fresh.generation == 2
                assert read_header(mmap_path).owner.pid == os.getpid()
                assert int(fresh.rows().abs().sum()) == 0, "a replaced file starts zeroed"
            assert not mmap_path.exists() and not lock_path.exists()
        finally:
            child.kill()


# ----------------------------------------------------------------- stale files


@pytest.mark.parametrize("state", [FileState.READY, FileState.CREATING])
def test_dead_pid_in_header_is_replaced_and_old_creator_leaves_replacement(
    iid: str, state: FileState
) -> None:
    mmap_path, lock_path = paths(iid)
    old = region(iid)
    old.create_next_view(16).fill_(7)
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # can never exist
    forge_header(mmap_path, owner_pid=dead_pid, generation=41, state=state)

    new = region(iid)
    assert new.is_creator and new.generation == 42
    assert int(new.rows().abs().sum()) == 0
    old.close()  # the old creator's file is gone; it must not unlink its successor
    assert mmap_path.exists() and lock_path.exists()
    assert read_header(mmap_path).generation == 42
    new.close()
    assert not mmap_path.exists() and not lock_path.exists()


def test_reused_pid_with_other_start_time_is_stale(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(iid) as old:
        start = read_header(mmap_path).owner.start_ticks
        assert start > 0
        forge_header(mmap_path, owner_start_ticks=start + 1)  # our pid, someone else's start
        with region(iid, rank=1) as new:
            assert new.is_creator and new.generation == 2
        assert not old.closed


def test_file_from_an_earlier_boot_is_stale(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(iid):
        forge_header(mmap_path, owner_boot_id=b"\x01" * 16)
        with region(iid, rank=1) as new:
            assert new.is_creator and new.generation == 2


def test_file_without_a_header_is_replaced(iid: str) -> None:
    mmap_path, _ = paths(iid)
    mmap_path.write_bytes(b"left behind by something that died mid-create")
    mmap_path.chmod(0o600)
    with region(iid) as r:
        assert r.is_creator and r.generation == 1
        assert mmap_path.stat().st_size == PAGE + 8 * 2 * PAGE


def test_owner_in_another_pid_namespace_is_presumed_alive(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(iid) as first:
        dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
        forge_header(mmap_path, owner_pid=dead_pid, owner_pid_namespace=first.generation + 12345)
        with region(iid, rank=1) as second:  # cannot judge the pid, so attach
            assert not second.is_creator and second.generation == 1
        with pytest.raises(SharedRegionLayoutError):  # and never replace it
            region(iid, num_blocks=9)


def test_live_owner_with_other_layout_is_an_error_not_a_replacement(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(iid) as owner:
        owner.create_next_view(8).fill_(5)
        with pytest.raises(SharedRegionLayoutError) as info:
            region(iid, rank=1, num_blocks=9)
        message = str(info.value)
        assert str(mmap_path) in message and "num_blocks=9" in message
        assert f"live pid {os.getpid()}" in message
        assert int(owner.rows()[:, :8].sum()) == 5 * 8 * 8  # untouched
        assert read_header(mmap_path).generation == 1


def test_header_of_another_format_version_is_presumed_alive(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(iid):
        raw = bytearray(mmap_path.read_bytes()[:PAGE])
        raw[8:12] = (1).to_bytes(4, "little")  # version 1: the format before ownership.py
        mmap_path.write_bytes(bytes(raw) + mmap_path.read_bytes()[PAGE:])
        with pytest.raises(SharedRegionError, match="version 1 header") as info:
            region(iid, rank=1)
        assert "presumed alive" in str(info.value)
        assert mmap_path.read_bytes()[8:12] == (1).to_bytes(4, "little")  # not replaced


# ----------------------------------------------------------------- a hostile local user

OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def assert_nothing_left(iid: str, directory: Path = SHM) -> None:
    left = sorted(p.name for p in directory.iterdir() if iid in p.name)
    assert left == [], f"a failed open left {left} behind"


def test_symlink_at_the_lock_path_is_never_followed(iid: str, tmp_path: Path) -> None:
    _, lock_path = paths(iid)
    target = tmp_path / "root-only" / "created-through-the-link"
    target.parent.mkdir(mode=0o700)
    lock_path.symlink_to(target)
    try:
        with pytest.raises(UnsafeSharedRegionError, match="symbolic link") as info:
            region(iid)
        assert str(lock_path) in str(info.value)
        assert isinstance(info.value, UnsafeFileError)
        assert not target.exists(), "the open followed the link"
        assert paths(iid)[0].exists() is False
        assert lock_path.is_symlink(), "a link we did not make is not ours to remove"
    finally:
        lock_path.unlink()


def test_symlink_at_the_region_path_never_attaches_to_another_pool(iid: str) -> None:
    other = f"{iid}-a"
    mmap_path, lock_path = paths(iid)
    with region(other) as engine_a:
        engine_a.create_next_view(64).fill_(7)
        mmap_path.symlink_to(engine_a.path)
        try:
            with pytest.raises(UnsafeSharedRegionError, match="symbolic link"):
                region(iid, rank=1)
            assert set(engine_a.rows()[:, :64].flatten().tolist()) == {7}
            assert not lock_path.exists(), "a failed open leaves no lock file"
        finally:
            mmap_path.unlink()
    assert_nothing_left(iid)


def test_dangling_symlink_at_the_region_path_creates_nothing(iid: str, tmp_path: Path) -> None:
    mmap_path, _ = paths(iid)
    target = tmp_path / "would-be-created"
    mmap_path.symlink_to(target)
    try:
        with pytest.raises(UnsafeSharedRegionError, match="symbolic link"):
            region(iid)
        assert not target.exists()
    finally:
        mmap_path.unlink()
    assert_nothing_left(iid)


def test_region_file_loosened_to_0666_is_refused(iid: str) -> None:
    with region(iid) as creator:
        creator.path.chmod(0o666)
        with pytest.raises(UnsafeSharedRegionError, match="mode 0666") as info:
            region(iid, rank=1)
        assert str(creator.path) in str(info.value)
        creator.path.chmod(0o600)
        with region(iid, rank=1) as attached:  # the same file, tightened again: fine
            assert not attached.is_creator


def test_lock_file_loosened_to_0644_is_refused(iid: str) -> None:
    with region(iid) as creator:
        lock_path = paths(iid)[1]
        lock_path.chmod(0o644)
        with pytest.raises(UnsafeSharedRegionError, match="mode 0644"):
            region(iid, rank=1)
        lock_path.chmod(0o600)
        assert not creator.closed


def test_hard_link_at_the_region_path_is_refused(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(f"{iid}-a") as engine_a:
        os.link(engine_a.path, mmap_path)
        try:
            with pytest.raises(UnsafeSharedRegionError, match="2 hard links"):
                region(iid, rank=1)
        finally:
            mmap_path.unlink()


@needs_root
@pytest.mark.parametrize("which", ["region", "lock"])
def test_files_of_another_uid_are_refused(iid: str, which: str) -> None:
    mmap_path, lock_path = paths(iid)
    with region(iid):
        os.chown(mmap_path if which == "region" else lock_path, OTHER_UID, OTHER_UID)
        with pytest.raises(UnsafeSharedRegionError, match=f"belongs to uid {OTHER_UID}"):
            region(iid, rank=1)
        os.chown(mmap_path if which == "region" else lock_path, 0, 0)


@needs_root
def test_a_squatted_region_name_is_refused_and_our_lock_file_removed(iid: str) -> None:
    mmap_path, lock_path = paths(iid)
    mmap_path.write_bytes(b"squatter")
    mmap_path.chmod(0o600)
    os.chown(mmap_path, OTHER_UID, OTHER_UID)
    try:
        with pytest.raises(UnsafeSharedRegionError, match=f"belongs to uid {OTHER_UID}"):
            region(iid)
        assert mmap_path.read_bytes() == b"squatter"  # not ours: neither used nor removed
        assert not lock_path.exists(), "the lock file we made is gone"
    finally:
        mmap_path.unlink()


@needs_root
def test_a_squatted_lock_name_is_refused_and_left_alone(iid: str) -> None:
    """The denial of service docs/memory.md describes: reported, nothing opened."""
    _, lock_path = paths(iid)
    lock_path.write_bytes(b"")
    lock_path.chmod(0o600)
    os.chown(lock_path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeSharedRegionError, match=f"belongs to uid {OTHER_UID}"):
        region(iid)
    assert lock_path.stat().st_uid == OTHER_UID
    assert not paths(iid)[0].exists()


def test_default_directory_is_private_to_this_uid() -> None:
    st = os.lstat(SHM)
    assert Path("/dev/shm") / f"aiokvo-{os.geteuid()}" == SHM
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700


def test_a_directory_others_can_write_without_the_sticky_bit_is_refused(
    iid: str, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeSharedRegionError, match="without the sticky bit"):
        region(iid, directory=shared)
    assert list(shared.iterdir()) == []
    shared.chmod(0o1777)  # like /dev/shm: fine, each file is checked on its own
    with region(iid, directory=shared) as r:
        assert r.directory == shared and r.path.parent == shared
    assert list(shared.iterdir()) == []


@needs_root
def test_a_squatted_default_directory_is_refused(
    iid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "shm"
    parent.mkdir(mode=0o1777)
    parent.chmod(0o1777)
    squatted = parent / f"aiokvo-{os.geteuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    monkeypatch.setattr(shared_region, "DEFAULT_DIRECTORY", str(parent))
    with pytest.raises(UnsafeSharedRegionError, match=f"belongs to uid {OTHER_UID}"):
        region(iid)
    assert list(squatted.iterdir()) == []
    squatted.rmdir()
    squatted.symlink_to(tmp_path)
    with pytest.raises(UnsafeSharedRegionError, match="symbolic link"):
        region(iid)


def test_a_missing_default_parent_is_a_config_error(
    iid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_region, "DEFAULT_DIRECTORY", str(tmp_path / "no-shm"))
    with pytest.raises(ConfigError, match="no-shm does not exist"):
        region(iid)


def test_a_failed_attach_leaves_no_lock_file_behind(iid: str) -> None:
    """A layout error against a live owner leaves the owner's files, and only those."""
    mmap_path, lock_path = paths(iid)
    with region(iid):
        with pytest.raises(SharedRegionLayoutError):
            region(iid, rank=1, num_blocks=9)
        assert mmap_path.exists() and lock_path.exists()  # the live creator's
    assert_nothing_left(iid)


# ----------------------------------------------------------------- waiting


def test_waiting_for_an_unfinished_creator_times_out_with_details(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(iid) as owner:
        forge_header(mmap_path, state=FileState.CREATING)
        started = time.monotonic()
        with pytest.raises(SharedRegionTimeoutError) as info:
            region(iid, rank=1, timeout=0.3)
        elapsed = time.monotonic() - started
        assert 0.3 <= elapsed < 10.3
        message = str(info.value)
        expected_size = PAGE + owner.size_bytes
        assert str(mmap_path) in message and f"{expected_size} bytes" in message
        assert "0.3s" in message and f"pid {os.getpid()}" in message
        assert isinstance(info.value, TimeoutError)


def test_waiter_attaches_once_the_creator_finishes(iid: str) -> None:
    mmap_path, _ = paths(iid)
    with region(iid) as owner:
        forge_header(mmap_path, state=FileState.CREATING)
        owner.create_next_view(4).fill_(3)
        finisher = threading.Timer(0.2, forge_header, (mmap_path,), {"state": FileState.READY})
        finisher.start()
        try:
            with region(iid, rank=1, timeout=20.0) as waiter:
                assert not waiter.is_creator
                assert set(waiter.rows()[:, :4].flatten().tolist()) == {3}
        finally:
            finisher.join()


def test_creation_lock_held_elsewhere_times_out(iid: str) -> None:
    _, lock_path = paths(iid)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(SharedRegionTimeoutError, match="creation lock"):
            region(iid, timeout=0.2)
    finally:
        os.close(fd)


def test_concurrent_openers_elect_exactly_one_creator(iid: str) -> None:
    barrier = threading.Barrier(4)
    opened: list[SharedOffloadRegion] = []
    failures: list[BaseException] = []

    def open_rank(rank: int) -> None:
        barrier.wait()
        try:
            opened.append(region(iid, num_workers=4, rank=rank, prefault=False))
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    threads = [threading.Thread(target=open_rank, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert failures == []
        assert sorted(r.is_creator for r in opened) == [False, False, False, True]
        assert {r.generation for r in opened} == {1}
    finally:
        for r in sorted(opened, key=lambda r: r.is_creator):
            r.close()
    assert not paths(iid)[0].exists()


# ----------------------------------------------------------------- files and cleanup


def test_file_mode_is_0600_whatever_the_umask(iid: str) -> None:
    old_umask = os.umask(0)
    try:
        with region(iid) as r:
            assert r.path.stat().st_mode & 0o777 == 0o600
            assert paths(iid)[1].stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)


def test_creator_unlinks_on_close_and_attacher_does_not(iid: str) -> None:
    mmap_path, lock_path = paths(iid)
    creator = region(iid, rank=0)
    attacher = region(iid, rank=1)
    assert creator.is_creator and not attacher.is_creator
    attacher.close()
    attacher.close()  # idempotent
    assert attacher.closed and mmap_path.exists()
    creator.close()
    creator.close()
    assert creator.closed and not mmap_path.exists() and not lock_path.exists()


def test_closed_region_refuses_new_views(iid: str) -> None:
    r = region(iid)
    r.close()
    with pytest.raises(SharedRegionError, match="closed"):
        r.create_next_view(8)
    with pytest.raises(SharedRegionError, match="closed"):
        r.rows()


def test_close_with_a_live_view_warns_and_keeps_the_memory_valid(iid: str) -> None:
    r = region(iid)
    view = r.create_next_view(64)
    with pytest.warns(ResourceWarning, match="views of it are alive"):
        r.close()
    assert not r.path.exists()
    view.fill_(9)  # still mapped: no crash, no use-after-unmap
    assert int(view.sum()) == 9 * 64 * 8
    del view


@pytest.mark.parametrize("free_blocks", [0, 1])
def test_creation_in_a_full_tmpfs_fails_and_leaves_no_file(
    iid: str, monkeypatch: pytest.MonkeyPatch, free_blocks: int
) -> None:
    real = os.statvfs

    def tiny(path: Any) -> Any:
        st = real(path)
        return types.SimpleNamespace(
            f_blocks=st.f_blocks, f_bavail=free_blocks, f_frsize=st.f_frsize
        )

    monkeypatch.setattr(os, "statvfs", tiny)
    with pytest.raises(SharedRegionError, match="bytes free, too few"):
        region(iid)
    assert not paths(iid)[0].exists()
    assert not paths(iid)[1].exists(), "a failed open leaves no lock file behind"


# ----------------------------------------------------------------- views and layout


def test_views_pack_layers_inside_the_rank_slice_with_row_stride(iid: str) -> None:
    with (
        region(iid, num_blocks=5, num_workers=3, page_bytes_per_rank=100, rank=1) as r,
        region(iid, num_blocks=5, num_workers=3, page_bytes_per_rank=100, rank=None) as whole,
    ):
        first, second = r.create_next_view(40), r.create_next_view(60)
        assert first.shape == (5, 40) and second.shape == (5, 60)
        assert first.dtype == torch.int8
        assert first.stride() == second.stride() == (300, 1)
        assert (first.storage_offset(), second.storage_offset()) == (100, 140)
        first.fill_(1)
        second.fill_(2)
        flat = whole.rows().flatten()
        assert whole.rows().shape == (5, 300)
        for b in range(5):
            row = flat[b * 300 : (b + 1) * 300]
            assert set(row[:100].tolist()) == {0}  # rank 0
            assert set(row[100:140].tolist()) == {1}
            assert set(row[140:200].tolist()) == {2}
            assert set(row[200:].tolist()) == {0}  # rank 2
        del first, second, flat, row


def test_overflowing_the_rank_slice_is_a_layout_error(iid: str) -> None:
    with region(iid, page_bytes_per_rank=100) as r:
        r.create_next_view(60)
        with pytest.raises(SharedRegionLayoutError) as info:
            r.create_next_view(41)
        assert "41 bytes" in str(info.value) and "40 left" in str(info.value)
        assert r.create_next_view(40).storage_offset() == 60


def test_no_rank_mode_maps_everything_but_has_no_slice(iid: str) -> None:
    with region(iid, rank=None, total_size_bytes=8 * 2 * PAGE + 123) as r:
        assert r.rank is None and r.size_bytes == 8 * 2 * PAGE + 123
        assert r.rows().shape == (8, 2 * PAGE)
        with pytest.raises(SharedRegionError, match="without a rank"):
            r.create_next_view(16)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"rank": -1}, "-1"),
        ({"rank": 2}, "got 2"),
        ({"rank": True}, "True"),
        ({"num_blocks": 0}, "num_blocks must be an int >= 1, got 0"),
        ({"num_workers": -3}, "num_workers must be an int >= 1, got -3"),
        ({"page_bytes_per_rank": 0}, "page_bytes_per_rank must be an int >= 1, got 0"),
        ({"page_bytes_per_rank": 1.5}, "got 1.5"),
        ({"total_size_bytes": 100}, "total_size_bytes=100 is too small"),
        ({"timeout": -1.0}, "got -1.0"),
        ({"directory": "/no/such/dir"}, "'/no/such/dir'"),
    ],
)
def test_invalid_arguments_name_the_bad_value(
    iid: str, overrides: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        region(iid, **overrides)
    assert needle in str(info.value)
    assert_nothing_left(iid)


@pytest.mark.parametrize("bad_id", ["", "a/b", "../x", ".hidden", "x" * 201, "sp ace"])
def test_invalid_instance_ids_are_refused(bad_id: str) -> None:
    with pytest.raises(ConfigError, match="instance_id"):
        region(bad_id)


def test_bad_view_size_is_refused(iid: str) -> None:
    with region(iid) as r, pytest.raises(ConfigError, match="got 0"):
        r.create_next_view(0)


# ----------------------------------------------------------------- pre-faulting


def own_pages(rank: int, num_blocks: int, num_workers: int, pbr: int) -> int:
    pages: set[int] = set()
    for b in range(num_blocks):
        start = b * pbr * num_workers + rank * pbr
        pages.update(range(start // PAGE, (start + pbr - 1) // PAGE + 1))
    return len(pages) * PAGE


@pytest.mark.parametrize("force_fallback", [False, True])
@pytest.mark.parametrize(("rank", "pbr"), [(0, PAGE), (1, PAGE), (1, 3000), (2, 6000)])
def test_prefault_populates_exactly_this_ranks_pages(
    iid: str, monkeypatch: pytest.MonkeyPatch, force_fallback: bool, rank: int, pbr: int
) -> None:
    if force_fallback:  # an advice the kernel rejects with EINVAL, like a pre-5.14 kernel
        monkeypatch.setattr(shared_region, "_MADV_POPULATE_WRITE", 0x7FFF)
    with region(iid, rank=rank, num_workers=3, page_bytes_per_rank=pbr, num_blocks=7) as r:
        assert r.prefault_method == ("touch" if force_fallback else "madvise")
        assert mapping_rss_bytes(r.path) == own_pages(rank, 7, 3, pbr)
        assert int(r.rows().abs().sum()) == 0  # touching rewrote values, never changed them


def test_no_prefault_leaves_pages_unpopulated(iid: str) -> None:
    with region(iid, prefault=False) as r:
        assert r.prefault_method == "none"
        assert mapping_rss_bytes(r.path) == 0


@pytest.mark.parametrize("force_fallback", [False, True])
def test_no_rank_prefault_covers_the_whole_region(
    iid: str, monkeypatch: pytest.MonkeyPatch, force_fallback: bool
) -> None:
    if force_fallback:
        monkeypatch.setattr(shared_region, "_MADV_POPULATE_WRITE", 0x7FFF)
    with region(iid, rank=None) as r:
        assert mapping_rss_bytes(r.path) == 8 * 2 * PAGE


# ----------------------------------------------------------------- pinning


class FakeRegistration:
    instances: list[FakeRegistration] = []  # noqa: RUF012 - per-test, reset by fixture

    def __init__(self, ptr: int, nbytes: int, *, driver: object = None) -> None:
        self.ptr, self.nbytes, self.driver = ptr, nbytes, driver
        self.calls: list[str] = []
        self.mapped_at_unregister: bool | None = None
        self.fail_unregister = False
        FakeRegistration.instances.append(self)

    def register(self) -> None:
        self.calls.append("register")

    def unregister(self) -> None:
        self.calls.append("unregister")
        maps = Path("/proc/self/maps").read_text()
        self.mapped_at_unregister = any(
            line.split()[0].startswith(f"{self.ptr:x}-") for line in maps.splitlines()
        )
        if self.fail_unregister:
            raise RuntimeError("cudaHostUnregister failed")


@pytest.fixture
def fake_pinned(monkeypatch: pytest.MonkeyPatch) -> type[FakeRegistration]:
    FakeRegistration.instances = []
    module = types.ModuleType("aiokvo.memory.pinned")
    module.HostRegistration = FakeRegistration  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "aiokvo.memory.pinned", module)
    return FakeRegistration


def test_pin_registers_the_whole_mapping_once_and_unpins_before_unmapping(
    iid: str, fake_pinned: type[FakeRegistration]
) -> None:
    driver = object()
    r = region(iid)
    pinned_before = r.is_pinned
    r.pin(driver=driver)
    r.pin(driver=driver)  # idempotent
    assert pinned_before is False and r.is_pinned and len(fake_pinned.instances) == 1
    reg = fake_pinned.instances[0]
    assert reg.ptr == r.rows().data_ptr() and reg.ptr % PAGE == 0
    assert reg.nbytes == 8 * 2 * PAGE and reg.driver is driver
    r.close()
    assert reg.calls == ["register", "unregister"]
    assert reg.mapped_at_unregister is True
    assert (r.is_pinned, r.path.exists()) == (False, False)


def test_failed_unpin_still_releases_everything(
    iid: str, fake_pinned: type[FakeRegistration]
) -> None:
    r = region(iid)
    r.pin()
    fake_pinned.instances[0].fail_unregister = True
    with pytest.raises(RuntimeError, match="cudaHostUnregister"):
        r.close()
    assert r.closed and not r.is_pinned and not r.path.exists()
    r.close()  # and stays closed


def test_pin_after_close_is_refused(iid: str, fake_pinned: type[FakeRegistration]) -> None:
    r = region(iid)
    r.close()
    with pytest.raises(SharedRegionError, match="closed"):
        r.pin()
    assert fake_pinned.instances == []


# ----------------------------------------------------------------- async


@pytest.mark.both_loops
async def test_open_runs_off_the_loop_and_async_with_closes(iid: str) -> None:
    region_ = await SharedOffloadRegion.open(
        iid, num_blocks=4, num_workers=1, page_bytes_per_rank=256, rank=0
    )
    async with region_ as r:
        assert r.is_creator and r.create_next_view(256).shape == (4, 256)
    assert r.closed and not r.path.exists()


async def test_cancelled_open_closes_the_region_it_made_late(
    iid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, lock_path = paths(iid)
    closed = threading.Event()
    real_close = SharedOffloadRegion.close

    def recording_close(self: SharedOffloadRegion) -> None:
        real_close(self)
        closed.set()

    monkeypatch.setattr(SharedOffloadRegion, "close", recording_close)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the opener blocks until we let go
        task = asyncio.ensure_future(
            SharedOffloadRegion.open(
                iid, num_blocks=2, num_workers=1, page_bytes_per_rank=64, rank=0, timeout=20
            )
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        os.close(fd)
    assert await asyncio.to_thread(closed.wait, 20.0)
    assert not paths(iid)[0].exists()
