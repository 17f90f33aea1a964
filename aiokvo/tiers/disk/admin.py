"""``aiokvo disk ls ROOT`` and ``aiokvo disk prune ROOT``: a disk tier's layouts, for operators.

Each layout (model, dtype, geometry, rank, format version) has its own
directory under a disk tier's root, and a changed deployment leaves the old
one behind with its slabs' space. These read a root by the tier's own rules
(docs/tiers.md, "Old layouts"): a slab is *live* while a process holds the
``flock`` on its index file, so a layout is in use while any of its slabs is
live, and only a layout none of whose slabs is live may be removed.

Nothing is reached through a symbolic link and nothing not ours is touched:
the root must pass the tier's own directory checks (it is not created), a
layout directory must be a private directory of this uid, and each file is
opened with :func:`~aiokvo.memory.ownership.open_private` (owner-only, one
name, no link). Anything else is listed as skipped, with the reason.

Pruning takes every slab lock of the layout (so no tier can start writing it
meanwhile), renames the directory out of the tier's way (a tier opening the
layout afterwards makes a fresh one), then removes the files. Reading the
locks is momentary: a tier opening the layout at that instant skips a slab
it finds locked and writes a new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from aiokvo.errors import ConfigError, UnsafeFileError
from aiokvo.memory.ownership import (
    FileState,
    OwnerHeader,
    check_directory,
    open_private,
)
from aiokvo.tiers.disk.format import (
    ENTRY_BYTES,
    GEOMETRY_BYTES,
    HEADER_PAGE,
    INDEX_MAGIC,
    SlabGeometry,
    unpack_entry,
)

__all__ = ["LayoutInfo", "SlabInfo", "Skipped", "list_layouts", "prune_layouts"]

_LAYOUT = re.compile(r"v\d+-[0-9a-f]{32}")
_INDEX = re.compile(r"slab-(\d{4,9})\.index")
_DATA = re.compile(r"slab-(\d{4,9})\.data")
_READ_ENTRIES = 4096  # entries read per pread


@dataclass(frozen=True, slots=True)
class SlabInfo:
    """One slab of a layout."""

    number: int
    live: bool
    """A process holds its writer's lock now."""
    writer_pid: int | None
    """The process that last took the slab (from its header; None: no valid header)."""
    slots: int
    slot_bytes: int
    blocks: int
    """Committed entries."""
    damaged: int
    """Entries whose seal does not match (counted, never served)."""
    disk_bytes: int
    """Bytes the slab's files take on disk (sparse data files count what is written)."""
    last_write: float
    """The latest modification time of its files (seconds since the epoch)."""


@dataclass(frozen=True, slots=True)
class LayoutInfo:
    """One layout directory under a root: its fingerprint name and its slabs."""

    name: str
    path: Path
    slabs: tuple[SlabInfo, ...]

    @property
    def live(self) -> bool:
        return any(s.live for s in self.slabs)

    @property
    def blocks(self) -> int:
        return sum(s.blocks for s in self.slabs)

    @property
    def disk_bytes(self) -> int:
        return sum(s.disk_bytes for s in self.slabs)

    @property
    def last_use(self) -> float | None:
        return max((s.last_write for s in self.slabs), default=None)

    @property
    def writers(self) -> tuple[int, ...]:
        """The pids holding a slab's lock now."""
        return tuple(s.writer_pid for s in self.slabs if s.live and s.writer_pid is not None)


@dataclass(frozen=True, slots=True)
class Skipped:
    """An entry of the root that is not a layout this uid may read or remove."""

    path: Path
    reason: str


def list_layouts(root: str | os.PathLike[str]) -> tuple[list[LayoutInfo], list[Skipped]]:
    """The layouts under ``root`` (by name), and what was skipped and why.

    Raises :class:`~aiokvo.errors.ConfigError` if ``root`` is missing or not a
    directory, and :class:`~aiokvo.errors.UnsafeFileError` if another uid could
    change it (the tier's own rule).
    """
    base = _root(root)
    layouts: list[LayoutInfo] = []
    skipped: list[Skipped] = []
    for name in sorted(os.listdir(base)):
        path = base / name
        if not _LAYOUT.fullmatch(name):
            if not name.startswith("."):
                skipped.append(Skipped(path, "not a layout directory (v<format>-<digest>)"))
            continue
        reason = _private_directory_problem(path)
        if reason is not None:
            skipped.append(Skipped(path, reason))
            continue
        try:
            layouts.append(LayoutInfo(name, path, tuple(_slabs(path))))
        except (UnsafeFileError, OSError) as exc:
            skipped.append(Skipped(path, str(exc)))
    return layouts, skipped


def prune_layouts(
    root: str | os.PathLike[str], *, dry_run: bool = False
) -> tuple[list[LayoutInfo], list[Skipped]]:
    """Remove the layouts under ``root`` that no process writes; what was (or, with
    ``dry_run``, would be) removed, and what was left and why."""
    layouts, skipped = list_layouts(root)
    removed: list[LayoutInfo] = []
    for layout in layouts:
        if layout.live:
            skipped.append(Skipped(layout.path, f"in use by pid {list(layout.writers)}"))
            continue
        if dry_run:
            removed.append(layout)
            continue
        reason = _remove(layout)
        if reason is None:
            removed.append(layout)
        else:
            skipped.append(Skipped(layout.path, reason))
    return removed, skipped


# -- reading ---------------------------------------------------------------------------


def _root(root: str | os.PathLike[str]) -> Path:
    path = Path(os.path.abspath(root))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(f"disk tier root {str(path)!r} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(f"{path} is a symbolic link; refusing to follow it (name the "
                              "directory it points to)")  # fmt: skip
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"disk tier root {str(path)!r} is not a directory")
    for ancestor in reversed(path.parents):
        check_directory(ancestor)
    check_directory(path)
    return path


def _private_directory_problem(path: Path) -> str | None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this uid {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, not owner-only"
    return None


def _slabs(path: Path) -> list[SlabInfo]:
    numbers = sorted(int(m.group(1)) for n in os.listdir(path) if (m := _INDEX.fullmatch(n)))
    found = []
    for number in numbers:
        index = path / f"slab-{number:04d}.index"
        try:
            fd = open_private(index, how="open")
        except FileNotFoundError:
            continue  # removed meanwhile
        try:
            live = not _try_lock(fd)  # ours for this instant, if nobody else's
            if not live:
                fcntl.flock(fd, fcntl.LOCK_UN)
            found.append(_slab(path, number, fd, live))
        finally:
            os.close(fd)
    return found


def _slab(path: Path, number: int, fd: int, live: bool) -> SlabInfo:
    header, _ = OwnerHeader.read(fd, magic=INDEX_MAGIC, payload_bytes=GEOMETRY_BYTES)
    geometry = None
    if header is not None and header.state == FileState.READY:
        geometry = SlabGeometry.unpack(header.payload)
    blocks = damaged = 0
    if geometry is not None:
        for start in range(0, geometry.num_slots, _READ_ENTRIES):
            count = min(_READ_ENTRIES, geometry.num_slots - start)
            raw = os.pread(fd, count * ENTRY_BYTES, HEADER_PAGE + start * ENTRY_BYTES)
            for i in range(0, len(raw) - ENTRY_BYTES + 1, ENTRY_BYTES):
                entry = unpack_entry(raw[i : i + ENTRY_BYTES])
                if entry is False:
                    damaged += 1
                elif entry is not None:
                    blocks += 1
    st = os.fstat(fd)
    disk, last = st.st_blocks * 512, st.st_mtime
    data = path / f"slab-{number:04d}.data"
    with contextlib.suppress(FileNotFoundError):
        dst = os.lstat(data)
        if stat.S_ISREG(dst.st_mode) and dst.st_uid == os.geteuid():
            disk += dst.st_blocks * 512
            last = max(last, dst.st_mtime)
    return SlabInfo(
        number=number, live=live, writer_pid=None if header is None else header.owner.pid,
        slots=0 if geometry is None else geometry.num_slots,
        slot_bytes=0 if geometry is None else geometry.slot_bytes,
        blocks=blocks, damaged=damaged, disk_bytes=disk, last_write=last,
    )  # fmt: skip


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


# -- removing --------------------------------------------------------------------------


def _remove(layout: LayoutInfo) -> str | None:
    """Remove ``layout`` if nobody writes it; None, or why it was left."""
    path = layout.path
    held: list[int] = []
    try:
        names = os.listdir(path)
        for name in names:  # every slab lock first: no tier may start writing it now
            if _INDEX.fullmatch(name):
                fd = open_private(path / name, how="open")
                held.append(fd)
                if not _try_lock(fd):
                    return f"{name} was taken by a process meanwhile"
        for name in names:
            if not (_INDEX.fullmatch(name) or _DATA.fullmatch(name)
                    or name.startswith(".probe-")):  # fmt: skip
                return f"holds {name!r}, which is not a slab file; left alone"
            st = os.lstat(path / name)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return f"{name} is not a regular file of this uid; left alone"
        grave = path.with_name(f".prune-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(path, grave)  # a tier opening this layout now makes a fresh directory
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(grave / name)
        os.rmdir(grave)
    except (UnsafeFileError, OSError) as exc:
        return str(exc)
    finally:
        for fd in held:
            os.close(fd)
    return None
