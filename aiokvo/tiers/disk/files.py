"""The disk tier's system calls, behind one seam, and the O_DIRECT probe.

Every read and write of block data and index entries goes through a
:class:`FileIO`: the default calls ``os`` directly (``os.preadv`` and
``os.pwritev`` release the GIL and move bytes straight between the file and
the CPU pool's pages, with no copy in between). Tests hand the tier a
subclass that fails (``ENOSPC``, ``EIO``), stalls or counts, the way host
copies are instrumented with ``copy_fn``. Opening files is not part of the
seam: it always goes through :mod:`aiokvo.memory.ownership` (never through
a symbolic link, owner-only, checked).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DIRECT_ALIGN", "FileIO", "ShortRead", "probe_direct", "read_all", "write_all"]

DIRECT_ALIGN = 4096
"""Alignment O_DIRECT transfers use here (buffer address, length, file offset)."""

Buffer = Any  # anything with the buffer protocol: numpy rows, memoryviews, bytes


class ShortRead(OSError):
    """The file ended before the bytes asked for (a truncated or never-written slot)."""


class FileIO:
    """The system calls of a disk tier's data path; subclass to inject faults.

    Methods run on the tier's I/O threads (never on the event loop), and may
    be called from several threads at once: the write thread, the read
    thread, and the other ``read_threads`` of a shared read.
    """

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)


def _views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """``buffers`` as memoryviews (the pool's already are: a transfer pays this per block,
    so nothing more; :func:`_skip` makes byte views in the rare short call)."""
    return [b if type(b) is memoryview else memoryview(b) for b in buffers]


def write_all(io: FileIO, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """Write every byte of ``buffers`` at ``offset``, resuming after short writes."""
    views = _views(buffers)
    total = sum(v.nbytes for v in views)
    done = io.pwritev(fd, views, offset)
    while done < total:  # rare: a signal, or a filesystem that writes in pieces
        rest = _skip(views, done)
        wrote = io.pwritev(fd, rest, offset + done)
        if wrote <= 0:
            raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset + done}")
        done += wrote
    return total


def read_all(io: FileIO, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """Fill every byte of ``buffers`` from ``offset``; :class:`ShortRead` at end of file."""
    views = _views(buffers)
    total = sum(v.nbytes for v in views)
    done = io.preadv(fd, views, offset)
    while done < total:
        got = io.preadv(fd, _skip(views, done), offset + done)
        if got <= 0:
            raise ShortRead(
                errno.ENODATA, f"the file ends {total - done} bytes before this block does"
            )
        done += got
    return total


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    rest: list[memoryview] = []
    for view in views:
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # sliced in bytes below
        if n >= view.nbytes:
            n -= view.nbytes
            continue
        rest.append(view[n:] if n else view)
        n = 0
    return rest


def probe_direct(directory: Path) -> bool:
    """Whether files in ``directory`` take O_DIRECT reads and writes of aligned pages.

    tmpfs refuses O_DIRECT at open (EINVAL); some filesystems accept the open
    and fail the I/O. A probe file (owner-only, never through a link) is
    written, read back and removed.
    """
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    path = directory / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | direct
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return False
    buf = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned
    try:
        buf.write(b"aiokvo" * 8)
        if os.pwritev(fd, [buf], 0) != DIRECT_ALIGN:
            return False
        check = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            return os.preadv(fd, [check], 0) == DIRECT_ALIGN and check[:48] == buf[:48]
        finally:
            check.close()
    except OSError:
        return False
    finally:
        buf.close()
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
