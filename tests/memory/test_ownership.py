"""The file-ownership rules on their own: headers, owner liveness, safe opens, the lock, release."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aiokvo.errors import ConfigError, UnsafeFileError
from aiokvo.memory.ownership import (
    HEADER_VERSION,
    OWNER_HEADER_BYTES,
    FileLock,
    FileState,
    OwnerHeader,
    OwnerIdentity,
    check_directory,
    file_identity,
    open_private,
    private_directory,
    release_created_file,
    secure_directory,
)

MAGIC = b"TESTKIND"
OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def dead_pid() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # can never exist


# ------------------------------------------------------------------ identity


def test_this_process_is_alive_and_identified_by_its_start_time() -> None:
    me = OwnerIdentity.current()
    assert me.pid == os.getpid() and me.start_ticks > 0 and len(me.boot_id) == 16
    assert me.is_alive()
    assert OwnerIdentity.of_process(os.getpid()) == me
    assert not dataclasses.replace(me, start_ticks=me.start_ticks + 1).is_alive()  # pid reused
    assert not dataclasses.replace(me, boot_id=b"\x01" * 16).is_alive()  # an earlier boot
    assert not dataclasses.replace(me, pid=dead_pid()).is_alive()


def test_a_pid_from_another_namespace_is_presumed_alive() -> None:
    me = OwnerIdentity.current()
    assert dataclasses.replace(me, pid=dead_pid(), pid_namespace=me.pid_namespace + 1).is_alive()


@pytest.mark.system
def test_a_killed_unreaped_child_is_dead() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as child:
        identity = OwnerIdentity.of_process(child.pid)
        assert identity is not None and identity.is_alive()
        child.kill()
        for _ in range(2000):
            if not identity.is_alive():
                break
            time.sleep(0.005)
        assert not identity.is_alive(), "a zombie counts as dead"
        child.wait()
    assert OwnerIdentity.of_process(child.pid) is None or not identity.is_alive()


# ------------------------------------------------------------------ the header


def test_header_round_trips_with_its_payload() -> None:
    header = OwnerHeader.create(MAGIC, generation=7, payload=b"layout!")
    assert header.state == FileState.CREATING and header.owner == OwnerIdentity.current()
    raw = header.ready().pack()
    assert len(raw) == header.size == OWNER_HEADER_BYTES + 7
    back = OwnerHeader.unpack(raw + b"\0" * 100, magic=MAGIC)
    assert back == dataclasses.replace(header, state=FileState.READY)
    assert OwnerHeader.version_of(raw, magic=MAGIC) == HEADER_VERSION


def test_anything_else_is_not_a_header() -> None:
    raw = OwnerHeader.create(MAGIC, generation=1, payload=b"abc").pack()
    assert OwnerHeader.unpack(raw, magic=b"OTHERKND") is None
    assert OwnerHeader.version_of(raw, magic=b"OTHERKND") is None
    assert OwnerHeader.unpack(raw[:-1], magic=MAGIC) is None  # payload cut short
    assert OwnerHeader.unpack(raw[:20], magic=MAGIC) is None
    bad_state = raw[:12] + (9).to_bytes(4, "little") + raw[16:]
    assert OwnerHeader.unpack(bad_state, magic=MAGIC) is None
    old = raw[:8] + (1).to_bytes(4, "little") + raw[12:]
    assert OwnerHeader.unpack(old, magic=MAGIC) is None
    assert OwnerHeader.version_of(old, magic=MAGIC) == 1  # ours, but another version


def test_header_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match="magic must be 8 bytes"):
        OwnerHeader.create(b"short", generation=1)
    with pytest.raises(ConfigError, match="boot_id must be 16 bytes"):
        OwnerHeader(MAGIC, FileState.READY, OwnerIdentity(1, 1, 1, b"x"), 1)


def test_header_reads_and_writes_through_a_descriptor(tmp_path: Path) -> None:
    fd = open_private(tmp_path / "f", how="create")
    try:
        header = OwnerHeader.create(MAGIC, generation=3, payload=b"12345678")
        header.write(fd)
        read, raw = OwnerHeader.read(fd, magic=MAGIC, payload_bytes=8)
        assert read == header and raw == header.pack()
    finally:
        os.close(fd)


# ------------------------------------------------------------------ opening files


def test_created_files_are_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        fd = open_private(tmp_path / "f", how="create")
    finally:
        os.umask(old)
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        open_private(tmp_path / "f", how="create")
    with pytest.raises(FileNotFoundError):
        open_private(tmp_path / "missing", how="open")


@pytest.mark.parametrize("how", ["open", "create", "either"])
def test_symlinks_are_never_followed(tmp_path: Path, how: str) -> None:
    target = tmp_path / "target"
    if how == "open":
        target.write_bytes(b"")
        target.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    with (
        pytest.raises(UnsafeFileError, match="symbolic link")
        if how != "create"
        else (pytest.raises(FileExistsError))
    ):
        open_private(link, how=how)  # type: ignore[arg-type]
    assert target.exists() == (how == "open"), "nothing was created through the link"


@pytest.mark.parametrize("mode", [0o666, 0o640, 0o604, 0o700])
def test_files_open_to_group_or_others_are_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"")
    path.chmod(mode)
    if mode == 0o700:  # owner-only: fine
        os.close(open_private(path))
        return
    with pytest.raises(UnsafeFileError, match=f"mode {mode:04o}"):
        open_private(path)
    with pytest.raises(UnsafeFileError, match=f"mode {mode:04o}"):
        open_private(path, how="either")
    assert stat.S_IMODE(path.stat().st_mode) == mode, "refused, not quietly fixed"


def test_non_regular_files_and_hard_links_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        open_private(fifo)
    path = tmp_path / "f"
    os.close(open_private(path, how="create"))
    os.link(path, tmp_path / "alias")
    with pytest.raises(UnsafeFileError, match="2 hard links"):
        open_private(path)


@needs_root
def test_another_uids_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    os.close(open_private(path, how="create"))
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match=f"belongs to uid {OTHER_UID}"):
        open_private(path)
    with pytest.raises(UnsafeFileError, match=f"belongs to uid {OTHER_UID}"):
        FileLock.acquire(path, deadline=time.monotonic() + 1)


# ------------------------------------------------------------------ directories


def test_directories_others_could_change_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    for mode, ok in ((0o700, True), (0o755, True), (0o777, False), (0o1777, True), (0o775, False)):
        d.chmod(mode)
        if ok:
            check_directory(d)
        else:
            with pytest.raises(UnsafeFileError, match="without the sticky bit"):
                check_directory(d)
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(UnsafeFileError, match="not a directory"):
        check_directory(f)


def test_private_directory_is_made_0700_and_then_checked(tmp_path: Path) -> None:
    made = private_directory(tmp_path, "mine")
    st = os.lstat(made)
    assert made == tmp_path / "mine" and stat.S_IMODE(st.st_mode) == 0o700
    assert private_directory(tmp_path, "mine") == made  # and reused
    made.chmod(0o755)
    with pytest.raises(UnsafeFileError, match="mode 0755"):
        private_directory(tmp_path, "mine")
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        private_directory(tmp_path, "link")
    (tmp_path / "plain").write_bytes(b"")
    with pytest.raises(UnsafeFileError, match="not a directory"):
        private_directory(tmp_path, "plain")


def test_secure_directory_makes_missing_directories_0700_whatever_the_umask(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a" / "b" / "root"
    old = os.umask(0)
    try:
        made = secure_directory(path)
    finally:
        os.umask(old)
    assert made == path
    for d in (tmp_path / "a", tmp_path / "a" / "b", path):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
    assert secure_directory(path) == path  # and reused
    assert secure_directory(Path(os.path.relpath(path))) == path  # made absolute


def test_secure_directory_refuses_links_files_and_what_others_could_change(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        secure_directory(tmp_path / "link")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(UnsafeFileError, match="not a directory"):
        secure_directory(tmp_path / "file")
    real.chmod(0o777)
    with pytest.raises(UnsafeFileError, match="without the sticky bit"):
        secure_directory(real)  # the directory itself
    with pytest.raises(UnsafeFileError, match="without the sticky bit"):
        secure_directory(real / "x" / "y")  # an ancestor
    assert not (real / "x").exists()  # nothing made under an unsafe ancestor
    with pytest.raises(ConfigError, match="sticky"):
        secure_directory(real, error=ConfigError)  # the caller's error type


@needs_root
def test_secure_directory_under_another_uids_directory_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match=f"belongs to uid {OTHER_UID}"):
        secure_directory(theirs / "root")
    assert not (theirs / "root").exists()


@needs_root
def test_private_directory_taken_by_another_uid_is_refused(tmp_path: Path) -> None:
    squatted = tmp_path / "taken"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match=f"belongs to uid {OTHER_UID}"):
        private_directory(tmp_path, "taken")


# ------------------------------------------------------------------ the lock


def test_lock_is_exclusive_and_times_out(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with FileLock.acquire(path, deadline=time.monotonic() + 1) as lock:  # type: ignore[union-attr]
        assert lock.held and stat.S_IMODE(path.stat().st_mode) == 0o600
        started = time.monotonic()
        assert FileLock.acquire(path, deadline=started + 0.1) is None
        assert time.monotonic() - started >= 0.1
    assert not lock.held
    again = FileLock.acquire(path, deadline=time.monotonic() + 1)
    assert again is not None
    again.release(unlink=True)
    again.release()  # idempotent
    assert not path.exists()


def _descriptors_on(path: Path) -> int:
    """How many of this process's descriptors are open on the file ``path`` names."""
    target = os.stat(path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor, too)
            continue
        count += (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino)
    return count


def test_a_waiter_never_keeps_a_lock_file_that_was_removed(tmp_path: Path) -> None:
    """The holder unlinks the lock file; the waiter, which had opened that inode,
    must lock the new file at the path, not the orphan."""
    path = tmp_path / "x.lock"
    holder = FileLock.acquire(path, deadline=time.monotonic() + 1)
    assert holder is not None
    got: list[FileLock | None] = []
    waiter = threading.Thread(
        target=lambda: got.append(FileLock.acquire(path, deadline=time.monotonic() + 10))
    )
    waiter.start()
    deadline = time.monotonic() + 30
    while _descriptors_on(path) < 2:  # until the waiter polls the old inode (not a sleep:
        assert time.monotonic() < deadline  # a slow machine would test nothing)
        time.sleep(0.001)
    holder.release(unlink=True)
    waiter.join()
    (lock,) = got
    assert lock is not None
    assert file_identity(os.lstat(path)) == file_identity(os.fstat(lock._fd))  # type: ignore[arg-type]
    lock.release(unlink=True)


# ------------------------------------------------------------------ release


def test_creator_release_removes_the_file_and_the_lock(tmp_path: Path) -> None:
    path, lock_path = tmp_path / "f", tmp_path / "f.lock"
    fd = open_private(path, how="create")
    os.close(open_private(lock_path, how="create"))
    try:
        assert release_created_file(path, lock_path, fd) is True
        assert not path.exists() and not lock_path.exists()
        assert release_created_file(path, lock_path, fd) is False  # already gone: fine
    finally:
        os.close(fd)


def test_creator_release_leaves_a_successors_files(tmp_path: Path) -> None:
    path, lock_path = tmp_path / "f", tmp_path / "f.lock"
    fd = open_private(path, how="create")
    try:
        os.unlink(path)  # a successor took us for dead and replaced the file
        os.close(open_private(path, how="create"))
        os.close(open_private(lock_path, how="create"))
        assert release_created_file(path, lock_path, fd) is False
        assert path.exists() and lock_path.exists()
    finally:
        os.close(fd)


def test_creator_release_without_the_lock_still_removes_its_file(tmp_path: Path) -> None:
    path, lock_path = tmp_path / "f", tmp_path / "f.lock"
    fd = open_private(path, how="create")
    held = FileLock.acquire(lock_path, deadline=time.monotonic() + 1)
    assert held is not None
    try:
        assert release_created_file(path, lock_path, fd, timeout=0.05) is True
        assert not path.exists() and lock_path.exists()  # someone holds the lock: theirs
    finally:
        held.release()
        os.close(fd)
