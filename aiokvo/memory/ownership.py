"""Who owns a file that several processes share, and how to create, open, lock and release it.

A process that creates a shared file (a
:class:`~aiokvo.memory.shared_region.SharedOffloadRegion` today, a disk tier's
directory and index files later) stamps it with an :class:`OwnerHeader`: a
magic naming the kind of file, a format version, a state, the creator's
:class:`OwnerIdentity` and a generation, then a payload of the caller's own
(a region's layout). Other processes read that header to tell a live owner's
file (attach to it, or refuse it) from a dead owner's (replace it), and a
:class:`FileLock` on a sidecar file serialises those decisions.

The rules every user of this module shares:

- Nothing is reached through a symbolic link. Every open uses ``O_NOFOLLOW``
  and every file is checked once it is open (:func:`check_private`): a
  regular file with one name, owned by this process's effective uid, with no
  group or other permission bits. Directories are checked too
  (:func:`check_directory`, :func:`private_directory`).
- Files are created ``O_CREAT | O_EXCL`` with mode 0600, whatever the umask.
- When in doubt the owner is presumed alive (a pid from another pid
  namespace, a header of another format version): a live owner's file is
  never replaced.
- The creator removes its file and the lock file when it is done, unless a
  successor replaced them after taking it for dead
  (:func:`release_created_file`).

Everything here is synchronous and cheap except :meth:`FileLock.acquire`,
which polls until its deadline; async callers run it on a thread. Unsafe
files raise :class:`~aiokvo.errors.UnsafeFileError`, or the subclass a
caller passes as ``error`` (the region passes its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import fcntl
import os
import stat
import struct
import time
from pathlib import Path
from types import TracebackType
from typing import Literal, Self, TypeAlias

from aiokvo.errors import ConfigError, UnsafeFileError

__all__ = [
    "HEADER_VERSION",
    "OWNER_HEADER_BYTES",
    "FileIdentity",
    "FileLock",
    "FileState",
    "OpenMode",
    "OwnerHeader",
    "OwnerIdentity",
    "check_directory",
    "check_private",
    "secure_directory",
    "file_identity",
    "open_private",
    "private_directory",
    "release_created_file",
]

HEADER_VERSION = 2
"""The format of :class:`OwnerHeader` this module writes and reads (see docs/memory.md)."""

# magic, version, state, owner pid, owner start ticks, pid namespace, boot id,
# generation, payload bytes, reserved (0). Every version keeps magic and version first.
_PREFIX = struct.Struct("<8sII qQQ16s Q II")
_VERSION_FIELD = struct.Struct("<8sI")

OWNER_HEADER_BYTES = _PREFIX.size
"""Bytes of the fixed part of a header; the caller's payload follows at this offset."""

_NO_BOOT_ID = bytes(16)
_LOCK_POLL_S = 0.005
_PRIVATE_FILE_MODE = 0o600
_PRIVATE_DIR_MODE = 0o700

FileIdentity: TypeAlias = tuple[int, int]
"""``(st_dev, st_ino)``: which file a path or descriptor names."""

OpenMode: TypeAlias = Literal["open", "create", "either"]
"""For :func:`open_private`: an existing file, a new one, or whichever is there."""

ErrorType: TypeAlias = type[UnsafeFileError]


def file_identity(st: os.stat_result) -> FileIdentity:
    """The identity of the file ``st`` describes."""
    return st.st_dev, st.st_ino


class FileState(enum.IntEnum):
    """How far its creator got with a file."""

    CREATING = 1
    """Made, but not yet sized or filled: peers wait (or replace it if the creator died)."""
    READY = 2
    """Complete: peers may use it."""


# ------------------------------------------------------------------ process identity


def _boot_id() -> bytes:
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return bytes.fromhex(text.replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return _NO_BOOT_ID


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state letter, start time in clock ticks)`` of ``pid``, or None if unknown."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rpartition(")")[2].split()  # the command name may contain spaces
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerIdentity:
    """A process, told apart from any later process that reuses its pid.

    ``start_ticks`` is field 22 of ``/proc/<pid>/stat`` (0: unknown),
    ``pid_namespace`` the inode of ``/proc/self/ns/pid`` (pids compare only
    inside one namespace; 0: unknown), ``boot_id`` the kernel's 16-byte boot
    id (a process from an earlier boot is gone, whatever its pid; zeros:
    unknown).
    """

    pid: int
    start_ticks: int
    pid_namespace: int
    boot_id: bytes

    @classmethod
    def current(cls) -> OwnerIdentity:
        """This process."""
        return cls.of_process(os.getpid()) or cls(os.getpid(), 0, _pid_namespace(), _boot_id())

    @classmethod
    def of_process(cls, pid: int) -> OwnerIdentity | None:
        """Process ``pid`` of this pid namespace, or None if ``/proc`` has no such process.

        A zombie (dead, not yet reaped) still has an identity; :meth:`is_alive`
        says it is dead.
        """
        info = _proc_stat(pid)
        if info is None:
            return None
        return cls(pid, info[1], _pid_namespace(), _boot_id())

    def is_alive(self) -> bool:
        """Whether this process may still be running.

        When in doubt (another pid namespace, an unreadable ``/proc``) the
        answer is yes: a live peer's file must never be replaced.
        """
        ours = _boot_id()
        if _NO_BOOT_ID not in (self.boot_id, ours) and self.boot_id != ours:
            return False
        if self.pid_namespace != _pid_namespace():
            return True
        if self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, belongs to someone else
        info = _proc_stat(self.pid)
        if info is None:
            return True
        state, start_ticks = info
        if state in ("Z", "X"):  # killed, not yet reaped by its parent
            return False
        return not (self.start_ticks and start_ticks != self.start_ticks)


# ------------------------------------------------------------------ the header


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerHeader:
    """The first bytes of a shared file: what it is, who made it, how far they got.

    ``magic`` (8 bytes) names the kind of file, so a reader never takes some
    other file for one of its own; ``payload`` is the kind's own data (a
    region's layout). The encoding is in docs/memory.md.
    """

    magic: bytes
    state: FileState
    owner: OwnerIdentity
    generation: int
    payload: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.magic, bytes) or len(self.magic) != 8:
            raise ConfigError(f"magic must be 8 bytes, got {self.magic!r}")
        if len(self.owner.boot_id) != 16:
            raise ConfigError(f"boot_id must be 16 bytes, got {self.owner.boot_id!r}")

    @classmethod
    def create(cls, magic: bytes, *, generation: int, payload: bytes = b"") -> OwnerHeader:
        """A header naming this process as the creator, in state ``CREATING``."""
        return cls(magic, FileState.CREATING, OwnerIdentity.current(), generation, payload)

    def ready(self) -> OwnerHeader:
        """The same header in state ``READY``."""
        return dataclasses.replace(self, state=FileState.READY)

    @property
    def size(self) -> int:
        """Bytes this header takes when packed."""
        return OWNER_HEADER_BYTES + len(self.payload)

    def pack(self) -> bytes:
        owner = self.owner
        prefix = _PREFIX.pack(
            self.magic, HEADER_VERSION, int(self.state),
            owner.pid, owner.start_ticks, owner.pid_namespace, owner.boot_id,
            self.generation, len(self.payload), 0,
        )  # fmt: skip
        return prefix + self.payload

    @classmethod
    def unpack(cls, raw: bytes, *, magic: bytes) -> OwnerHeader | None:
        """The header at the start of ``raw``, or None if there is no valid one of
        kind ``magic`` and version :data:`HEADER_VERSION` (:meth:`version_of` tells
        "another version" apart from "not ours")."""
        if len(raw) < OWNER_HEADER_BYTES:
            return None
        fields = _PREFIX.unpack_from(raw)
        (found, version, state, pid, start, namespace, boot, generation, size, _) = fields
        if found != magic or version != HEADER_VERSION:
            return None
        if state not in FileState._value2member_map_ or len(raw) < OWNER_HEADER_BYTES + size:
            return None
        payload = bytes(raw[OWNER_HEADER_BYTES : OWNER_HEADER_BYTES + size])
        owner = OwnerIdentity(pid, start, namespace, boot)
        return cls(found, FileState(state), owner, generation, payload)

    @staticmethod
    def version_of(raw: bytes, *, magic: bytes) -> int | None:
        """The format version of a header of kind ``magic`` at the start of ``raw``,
        or None if ``raw`` does not start with one (of any version)."""
        if len(raw) < _VERSION_FIELD.size:
            return None
        found, version = _VERSION_FIELD.unpack_from(raw)
        return int(version) if found == magic else None

    @classmethod
    def read(
        cls, fd: int, *, magic: bytes, payload_bytes: int = 0
    ) -> tuple[OwnerHeader | None, bytes]:
        """``(header or None, the raw bytes read)`` from the start of ``fd``."""
        raw = os.pread(fd, OWNER_HEADER_BYTES + payload_bytes, 0)
        return cls.unpack(raw, magic=magic), raw

    def write(self, fd: int) -> None:
        """Write this header at the start of ``fd``."""
        os.pwrite(fd, self.pack(), 0)


# ------------------------------------------------------------------ files and directories


def check_private(st: os.stat_result, path: Path, *, error: ErrorType = UnsafeFileError) -> None:
    """Raise ``error`` unless ``st`` is a regular file with one name, owned by this
    process's effective uid, with no group or other permission bits.

    Such a file can only have been made or loosened by this uid (or root), so
    nobody else can read, write, swap or alias it.
    """
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} exists but is not a regular file (mode {st.st_mode:#o})")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise error(
            f"{path} belongs to uid {st.st_uid}, not to this process's uid {uid}; refusing it"
        )
    if st.st_mode & 0o077:
        raise error(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, open to group or others; "
            f"shared files must be owner-only ({_PRIVATE_FILE_MODE:04o}); refusing it"
        )
    if st.st_nlink > 1:
        raise error(f"{path} has {st.st_nlink} hard links; refusing a file with other names")


def open_private(
    path: Path, *, how: OpenMode = "open", error: ErrorType = UnsafeFileError, flags: int = 0
) -> int:
    """A read-write descriptor on ``path``, never through a symbolic link, checked
    with :func:`check_private`.

    ``how="create"`` makes a new file (mode 0600 whatever the umask) and raises
    ``FileExistsError`` if the name is taken, by anything (a symbolic link
    included); ``"open"`` opens an existing file and raises
    ``FileNotFoundError`` if there is none; ``"either"`` creates it or opens
    the one that is there. A symbolic link, or a file that fails the check,
    raises ``error`` naming the path and what is wrong; nothing is written.
    ``flags`` are added to the open's flags (``os.O_DIRECT`` for a disk tier).
    """
    if how == "either":
        for _ in range(100):  # only loops while another process creates and removes it
            try:
                return open_private(path, how="create", error=error, flags=flags)
            except FileExistsError:
                pass
            try:
                return open_private(path, how="open", error=error, flags=flags)
            except FileNotFoundError:
                pass
        raise error(f"{path} keeps appearing and disappearing; refusing to guess")
    flags |= os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if how == "create":
        flags |= os.O_CREAT | os.O_EXCL
    elif how != "open":
        raise ConfigError(f"how must be 'open', 'create' or 'either', got {how!r}")
    try:
        fd = os.open(path, flags, _PRIVATE_FILE_MODE)
    except OSError as exc:
        _raise_unsafe(exc, path, error)
        raise
    try:
        if how == "create":
            os.fchmod(fd, _PRIVATE_FILE_MODE)  # the umask may have removed bits, never added
        check_private(os.fstat(fd), path, error=error)
    except BaseException:
        if how == "create":
            with contextlib.suppress(OSError):
                os.unlink(path)  # before closing: the name still means our inode
        os.close(fd)
        raise
    return fd


def _raise_unsafe(exc: OSError, path: Path, error: ErrorType) -> None:
    """Turn an open's failure into ``error`` where the path itself is the problem."""
    if exc.errno == errno.ELOOP:
        raise error(f"{path} is a symbolic link; refusing to follow it") from None
    if exc.errno == errno.EACCES:  # e.g. fs.protected_regular: another uid's file in /dev/shm
        try:
            st = os.lstat(path)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise error(f"{path} is a symbolic link; refusing to follow it") from None
        if st.st_uid != os.geteuid():
            raise error(
                f"{path} belongs to uid {st.st_uid}, not to this process's uid "
                f"{os.geteuid()}; refusing it"
            ) from None


def check_directory(path: Path, *, error: ErrorType = UnsafeFileError) -> None:
    """Raise ``error`` unless nobody but this uid and root can change ``path``'s entries.

    The directory must belong to this uid or to root, and may be writable by
    group or others only with the sticky bit set (as ``/dev/shm`` and
    ``/tmp`` are), which stops others from renaming or removing our files.
    Links on the way to it are followed: they are the caller's own choice.
    """
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise error(f"{path} is not a directory")
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise error(
            f"directory {path} belongs to uid {st.st_uid}, neither this process's uid {uid} "
            "nor root; its owner could swap the files in it"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise error(
            f"directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: writable by "
            "group or others without the sticky bit, so they could swap the files in it"
        )


def secure_directory(path: Path, *, error: ErrorType = UnsafeFileError) -> Path:
    """``path`` as a directory nobody but this uid (and root) controls, made if missing.

    For a directory the caller names (a disk tier's root), the rules ssh's
    ``StrictModes`` applies to a home directory: every directory above it
    must pass :func:`check_directory` (another uid able to rename an
    ancestor could swap the whole tree), and so must ``path`` itself, which
    must not be a symbolic link either. Missing directories are made one at a time with mode
    0700 whatever the umask (``os.makedirs`` would leave the parents to the
    umask), and checked once made. Returns the absolute path.
    """
    path = Path(os.path.abspath(path))
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for ancestor in reversed(probe.parents):
        check_directory(ancestor, error=error)
    for directory in [probe, *reversed(missing)]:
        if directory in missing:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, _PRIVATE_DIR_MODE)
        if directory != path:
            check_directory(directory, error=error)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path} is a symbolic link; refusing to follow it (name the directory "
                    "it points to)")
    if not stat.S_ISDIR(st.st_mode):
        raise error(f"{path} exists but is not a directory")
    check_directory(path, error=error)
    return path


def private_directory(parent: Path, name: str, *, error: ErrorType = UnsafeFileError) -> Path:
    """``parent / name``: a directory only this uid can use, created (0700) if missing.

    Refused with ``error`` if it is a symbolic link, not a directory, another
    uid's, or open to group or others (someone took the name first: that
    denies service but reaches nothing of ours). ``parent`` must pass
    :func:`check_directory`. The directory is left in place when its files
    are gone, as tmux leaves ``/tmp/tmux-<uid>``.
    """
    check_directory(parent, error=error)
    path = parent / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, _PRIVATE_DIR_MODE)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path} is a symbolic link; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise error(f"{path} exists but is not a directory")
    if st.st_uid != os.geteuid():
        raise error(
            f"directory {path} belongs to uid {st.st_uid}, not to this process's uid "
            f"{os.geteuid()}; pass another directory"
        )
    if st.st_mode & 0o077:
        raise error(
            f"directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be "
            f"owner-only ({_PRIVATE_DIR_MODE:04o})"
        )
    return path


# ------------------------------------------------------------------ the creation lock


class FileLock:
    """An exclusive ``flock`` on a sidecar lock file (0600, created if missing).

    Hold it while deciding whether to create, attach to or replace the file
    it guards. A holder may remove the lock file (``release(unlink=True)``),
    so a waiter could end up locking an inode nobody else sees: after
    locking, :meth:`acquire` checks that the path still names the inode it
    locked, and otherwise starts again. Use as a context manager or call
    :meth:`release`.
    """

    __slots__ = ("_fd", "path")

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(
        cls, path: Path, *, deadline: float, error: ErrorType = UnsafeFileError
    ) -> FileLock | None:
        """The lock on ``path``, or None once ``time.monotonic()`` passes ``deadline``."""
        while True:
            fd = open_private(path, how="either", error=error)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            os.close(fd)
                            return None
                        time.sleep(_LOCK_POLL_S)
                if _names(path, fd):
                    return cls(path, fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, *, unlink: bool = False) -> None:
        """Let go (idempotent); with ``unlink``, first remove the lock file if the
        path still names it."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if unlink and _names(self.path, fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.release()

    def __repr__(self) -> str:
        return f"<FileLock {self.path} {'held' if self.held else 'released'}>"


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed) names the file open as ``fd``."""
    try:
        on_disk = os.lstat(path)
    except FileNotFoundError:
        return False
    return file_identity(on_disk) == file_identity(os.fstat(fd))


def release_created_file(
    path: Path,
    lock_path: Path,
    fd: int,
    *,
    timeout: float = 2.0,
    error: ErrorType = UnsafeFileError,
) -> bool:
    """The creator's last step: remove ``path`` and its lock file, unless replaced.

    ``fd`` is the creator's open descriptor of the file it made; it must stay
    open until this returns, so that the inode cannot be freed and reused by a
    successor's file (the comparison would then be fooled). Under the lock
    (waiting up to ``timeout`` seconds), ``path`` is removed if it still names
    that file, and then the lock file too. If ``path`` now names another
    file, a successor took the creator for dead and replaced it: both names
    are the successor's and stay. Without the lock the file is still removed
    (if ours) but the lock file, which someone holds, stays. Never raises for
    a file that is gone; returns whether the file was removed.
    """
    identity = file_identity(os.fstat(fd))
    try:
        lock = FileLock.acquire(lock_path, deadline=time.monotonic() + timeout, error=error)
    except (OSError, UnsafeFileError):
        lock = None  # an unusable lock file is not ours to remove
    removed = successor = False
    try:
        try:
            successor = file_identity(os.lstat(path)) != identity
        except FileNotFoundError:
            pass
        else:
            if not successor:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed = True
    finally:
        if lock is not None:
            lock.release(unlink=not successor)
    return removed
