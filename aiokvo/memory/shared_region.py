"""A CPU offload pool in one ``/dev/shm`` file, shared by the ranks of one engine.

Each rank (worker process) maps the same file. Every block is one *row*; a row
holds the pages of all ranks side by side, so rank ``r``'s bytes for block
``b`` start at ``b * row_stride + r * page_bytes_per_rank``. A rank carves its
per-layer views out of its own slice of every row with :meth:`create_next_view`.

The file lives in a per-user directory (``/dev/shm/aiokvo-<uid>``, mode 0700)
unless the caller names one, and starts with a one-page header (see
``docs/memory.md``) naming the creator and the layout. Who owns the file, how
it is opened (never through a symlink, always checked for owner and mode),
locked, judged stale and removed are the rules of
:mod:`aiokvo.memory.ownership`; this module adds the layout, the mapping and
the views.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import gc
import importlib
import logging
import mmap
import os
import stat
import struct
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, Self

import torch

from aiokvo._util import AsyncResource, check_int, check_name
from aiokvo.errors import (
    ConfigError,
    SharedRegionError,
    SharedRegionLayoutError,
    SharedRegionTimeoutError,
    UnsafeSharedRegionError,
)
from aiokvo.memory.ownership import (
    HEADER_VERSION,
    FileLock,
    FileState,
    OwnerHeader,
    check_directory,
    open_private,
    private_directory,
    release_created_file,
)

__all__ = [
    "DEFAULT_DIRECTORY",
    "REGION_MAGIC",
    "PrefaultMethod",
    "SharedOffloadRegion",
    "default_directory",
]

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = "/dev/shm"
"""The tmpfs that holds each user's region directory (see :func:`default_directory`)."""

REGION_MAGIC = b"AIOKVOSR"
"""The :class:`~aiokvo.memory.ownership.OwnerHeader` magic of a region file."""

PrefaultMethod = Literal["madvise", "touch", "none"]

# Linux 5.14+; Python only names it from 3.13 on (the value is ABI-stable).
_MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE = mmap.ALLOCATIONGRANULARITY  # mmap offsets must be multiples of this
_HEADER_BYTES = _PAGE  # the data area starts on the next page boundary
_CLOSE_LOCK_TIMEOUT_S = 2.0


class _Registration(Protocol):
    """What :meth:`SharedOffloadRegion.pin` needs from ``aiokvo.memory.pinned``."""

    def register(self) -> Any: ...

    def unregister(self) -> Any: ...


# --------------------------------------------------------------------------- layout

# header bytes, data bytes, num_blocks, num_workers, page_bytes_per_rank: the header's payload
_LAYOUT = struct.Struct("<QQQQQ")


@dataclasses.dataclass(frozen=True)
class _Layout:
    header_bytes: int
    data_bytes: int
    num_blocks: int
    num_workers: int
    page_bytes_per_rank: int

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + _round_up(self.data_bytes, _PAGE)

    def pack(self) -> bytes:
        return _LAYOUT.pack(*dataclasses.astuple(self))

    @classmethod
    def unpack(cls, payload: bytes) -> _Layout | None:
        if len(payload) != _LAYOUT.size:
            return None
        return cls(*_LAYOUT.unpack(payload))


@dataclasses.dataclass(frozen=True)
class _Opened:
    fd: int
    creator: bool
    generation: int


@dataclasses.dataclass(frozen=True)
class _NotReady:
    """A live creator has made the file but not finished sizing it."""

    size: int
    owner_pid: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def default_directory() -> Path:
    """``/dev/shm/aiokvo-<euid>``: where regions live unless ``directory=`` is given.

    Created (mode 0700) on first use and checked every time: a symbolic
    link, another uid's directory or one open to others is refused with
    :class:`~aiokvo.errors.UnsafeSharedRegionError`. Other users cannot
    create, replace or link anything inside it.
    """
    parent = Path(DEFAULT_DIRECTORY)
    if not parent.is_dir():
        raise ConfigError(f"{parent} does not exist or is not a directory; pass directory=")
    return private_directory(parent, f"aiokvo-{os.geteuid()}", error=UnsafeSharedRegionError)


# ------------------------------------------------------------------ the region


def _release_file(fd: int, path: Path, lock_path: Path, unlink: bool, pid: int) -> None:
    """The creator removes the file and its lock; everyone closes the region's fd.

    Runs from :meth:`SharedOffloadRegion.close` or, if the region was never
    closed, when it is garbage-collected or the interpreter exits. A forked
    child shares the creator's object but not its duty to unlink. The fd
    stays open until the file is removed, so its inode cannot be reused by a
    successor's file in the meantime.
    """
    try:
        if unlink and os.getpid() == pid:
            release_created_file(
                path, lock_path, fd, timeout=_CLOSE_LOCK_TIMEOUT_S, error=UnsafeSharedRegionError
            )
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


class SharedOffloadRegion(AsyncResource):
    """One engine's CPU offload pool, mapped by each of its ranks.

    Every rank constructs one with the same ``instance_id`` and layout. The
    first to arrive creates the file (``O_CREAT | O_EXCL``, mode 0600); the
    others attach, waiting up to ``timeout`` seconds for it to be ready. The
    creator removes the file on :meth:`close`; the others never do.

    The file is ``aiokvo_offload_<instance_id>.mmap`` in ``directory``
    (default: :func:`default_directory`, a private per-user directory). A
    directory others could change, a symbolic link, or a file that is not
    this uid's and owner-only raises
    :class:`~aiokvo.errors.UnsafeSharedRegionError`; nothing is mapped.

    ``rank=None`` maps the whole region without a slice of its own (for a
    reader that needs every rank's rows, see :meth:`rows`).
    """

    def __init__(
        self,
        instance_id: str,
        *,
        num_blocks: int,
        num_workers: int,
        page_bytes_per_rank: int,
        rank: int | None,
        total_size_bytes: int | None = None,
        directory: str | os.PathLike[str] | None = None,
        timeout: float = 30.0,
        prefault: bool = True,
    ) -> None:
        num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        num_workers = check_int("num_workers", num_workers, minimum=1)
        page_bytes_per_rank = check_int("page_bytes_per_rank", page_bytes_per_rank, minimum=1)
        if rank is not None:
            rank = check_int("rank", rank, minimum=0, maximum=num_workers - 1)
        instance_id = check_name("instance_id", instance_id)
        if not timeout >= 0:
            raise ConfigError(f"timeout must be >= 0 seconds, got {timeout!r}")
        row_stride = page_bytes_per_rank * num_workers
        needed = num_blocks * row_stride
        if total_size_bytes is None:
            total_size_bytes = needed
        total_size_bytes = check_int("total_size_bytes", total_size_bytes, minimum=1)
        if total_size_bytes < needed:
            raise ConfigError(
                f"total_size_bytes={total_size_bytes} is too small for {num_blocks} blocks of "
                f"{num_workers} x {page_bytes_per_rank} bytes (needs {needed})"
            )
        self._layout = _Layout(
            _HEADER_BYTES, total_size_bytes, num_blocks, num_workers, page_bytes_per_rank
        )
        self._rank = rank
        self._row_stride = row_stride
        self._timeout = float(timeout)
        self._directory = _checked_directory(directory)
        self._path = self._directory / f"aiokvo_offload_{instance_id}.mmap"
        self._lock_path = self._directory / f"aiokvo_offload_{instance_id}.lock"
        self._views: list[torch.Tensor] = []
        self._next_offset = 0 if rank is None else rank * page_bytes_per_rank
        self._registration: _Registration | None = None
        self._closed = False
        self._prefault_method: PrefaultMethod = "none"

        fd, self._creator, self._generation = self._open_file()
        self._finalizer = weakref.finalize(
            self, _release_file, fd, self._path, self._lock_path, self._creator, os.getpid()
        )
        try:
            self._mmap = mmap.mmap(
                fd,
                self._layout.file_bytes - _HEADER_BYTES,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=_HEADER_BYTES,
            )
            if prefault:
                self._prefault_method = self._prefault()
            buffer = memoryview(self._mmap)
            self._base: torch.Tensor | None = torch.frombuffer(buffer, dtype=torch.int8)
            del buffer  # torch holds its own export; ours must not outlive close()
        except BaseException:
            self._closed = True
            self._base = None
            if hasattr(self, "_mmap"):
                with contextlib.suppress(BufferError):
                    self._mmap.close()
            self._finalizer()
            raise

    # ---------------------------------------------------------------- opening

    @classmethod
    async def open(cls, instance_id: str, **kwargs: Any) -> SharedOffloadRegion:
        """Construct on a worker thread so that waiting for a peer never blocks the loop.

        Cancelling the caller does not leak the region: if the thread finishes
        after the cancellation, the region it made is closed.
        """
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, functools.partial(cls, instance_id, **kwargs))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_orphan)
            raise

    def _open_file(self) -> tuple[int, bool, int]:
        """``(fd, is_creator, generation)``: create, attach or replace, under the lock.

        A failed attempt removes the lock file unless a region file remains
        whose creator will (so a failed open leaves nothing behind).
        """
        deadline = time.monotonic() + self._timeout
        while True:
            lock = FileLock.acquire(
                self._lock_path, deadline=deadline, error=UnsafeSharedRegionError
            )
            if lock is None:
                raise SharedRegionTimeoutError(
                    f"timed out after {self._timeout}s waiting for the creation lock "
                    f"{self._lock_path} of {self._path} (expected size "
                    f"{self._layout.file_bytes} bytes); another process holds it"
                )
            try:
                attempt = self._create_or_attach()
            except BaseException:
                lock.release(unlink=not self._region_file_remains())
                raise
            lock.release()
            if isinstance(attempt, _Opened):
                return attempt.fd, attempt.creator, attempt.generation
            if time.monotonic() >= deadline:
                raise SharedRegionTimeoutError(
                    f"timed out after {self._timeout}s waiting for {self._path} to reach "
                    f"{self._layout.file_bytes} bytes and be marked ready (it has "
                    f"{attempt.size} bytes; creator pid {attempt.owner_pid} is alive)"
                )
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))

    def _region_file_remains(self) -> bool:
        """Whether a region file of this uid is there (its creator removes the lock)."""
        try:
            st = os.lstat(self._path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()

    def _create_or_attach(self) -> _Opened | _NotReady:
        """One attempt, with the lock held."""
        generation = 1
        for _ in range(2):  # at most: replace a stale file, then create
            try:
                return _Opened(self._create(generation), True, generation)
            except FileExistsError:
                pass
            try:
                fd = open_private(self._path, how="open", error=UnsafeSharedRegionError)
            except FileNotFoundError:
                continue
            try:
                st = os.fstat(fd)
                header, raw = OwnerHeader.read(fd, magic=REGION_MAGIC, payload_bytes=_LAYOUT.size)
                if header is None:
                    self._check_version(raw)
                if header is not None and header.owner.is_alive():
                    layout = _Layout.unpack(header.payload)
                    if layout != self._layout:
                        found = "an unreadable layout" if layout is None else _describe(layout)
                        raise SharedRegionLayoutError(
                            f"{self._path} is in use by live pid {header.owner.pid} with layout "
                            f"{found}, but this rank asked for {_describe(self._layout)}"
                        )
                    if header.state == FileState.READY and st.st_size >= self._layout.file_bytes:
                        attached, fd = fd, -1
                        return _Opened(attached, False, header.generation)
                    return _NotReady(st.st_size, header.owner.pid)  # creator still busy
                log.warning(
                    "replacing stale shared region %s (%s)", self._path,
                    "no valid header" if header is None
                    else f"owner pid {header.owner.pid} is gone, generation {header.generation}",
                )  # fmt: skip
                generation = header.generation + 1 if header else 1
                os.unlink(self._path)
            finally:
                if fd >= 0:
                    os.close(fd)
        raise SharedRegionError(f"{self._path} keeps reappearing while being replaced")

    def _check_version(self, raw: bytes) -> None:
        """A header of another format version: its owner cannot be judged, so presume it alive."""
        version = OwnerHeader.version_of(raw, magic=REGION_MAGIC)
        if version is not None and version != HEADER_VERSION:
            raise SharedRegionError(
                f"{self._path} has a version {version} header and this aiokvo reads version "
                f"{HEADER_VERSION}; its owner cannot be checked, so it is presumed alive. "
                "Remove the file by hand if no engine uses it"
            )

    def _create(self, generation: int) -> int:
        """Make the file: header (creating), size, header (ready). Raises FileExistsError."""
        fd = open_private(self._path, how="create", error=UnsafeSharedRegionError)
        try:
            self._check_room()
            header = OwnerHeader.create(
                REGION_MAGIC, generation=generation, payload=self._layout.pack()
            )
            header.write(fd)
            os.ftruncate(fd, self._layout.file_bytes)
            header.ready().write(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self._path)  # before closing: the name still means our inode
            os.close(fd)
            raise
        return fd

    def _check_room(self) -> None:
        """Fail now, with sizes, rather than with SIGBUS when a page is first touched."""
        vfs = os.statvfs(self._path.parent)
        free = vfs.f_bavail * vfs.f_frsize
        if vfs.f_blocks and free < self._layout.file_bytes:  # f_blocks 0: size unknown
            raise SharedRegionError(
                f"{self._path.parent} has {free} bytes free, too few for a "
                f"{self._layout.file_bytes}-byte region {self._path}"
            )

    # ---------------------------------------------------------------- prefault

    def _own_spans(self) -> Iterator[tuple[int, int]]:
        """``(start, end)`` byte spans this process will touch, in order."""
        lay = self._layout
        if self._rank is None:
            yield 0, lay.data_bytes
            return
        first = self._rank * lay.page_bytes_per_rank
        for block in range(lay.num_blocks):
            start = block * self._row_stride + first
            yield start, start + lay.page_bytes_per_rank

    def _page_ranges(self) -> Iterator[tuple[int, int]]:
        """Page-aligned ``(offset, length)`` covering :meth:`_own_spans`, merged."""
        current: tuple[int, int] | None = None
        for start, end in self._own_spans():
            lo, hi = start // _PAGE * _PAGE, _round_up(end, _PAGE)
            if current is not None and lo <= current[1]:
                current = (current[0], max(current[1], hi))
                continue
            if current is not None:
                yield current[0], current[1] - current[0]
            current = (lo, hi)
        if current is not None:
            yield current[0], current[1] - current[0]

    def _prefault(self) -> PrefaultMethod:
        """Fault this rank's pages in now, so the first DMA does not take page faults."""
        try:
            for offset, length in self._page_ranges():
                assert offset % _PAGE == 0
                self._mmap.madvise(_MADV_POPULATE_WRITE, offset, length)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # ENOMEM, EFAULT: the tmpfs is full
                raise SharedRegionError(
                    f"could not pre-fault {self._path} ({self._layout.file_bytes} bytes): "
                    f"{exc.strerror}; is {self._path.parent} large enough?"
                ) from exc
            self._touch_pages()  # kernel older than 5.14
            return "touch"
        return "madvise"

    def _touch_pages(self) -> None:
        """Fault pages in by hand: rewrite one own byte per page, or just read.

        Only bytes this rank owns are written (with their own value), so a peer
        writing its half of a shared page at the same time is never clobbered.
        """
        base = torch.frombuffer(memoryview(self._mmap), dtype=torch.int8)
        try:
            lay = self._layout
            if self._rank is None:
                int(base[::_PAGE].sum())  # reading faults the page in; writing could race
                return
            span = lay.page_bytes_per_rank
            first = self._rank * span
            per_row = _round_up(span, _PAGE) // _PAGE
            stride = self._row_stride
            torch.as_strided(base, (lay.num_blocks, per_row), (stride, _PAGE), first).add_(0)
            torch.as_strided(base, (lay.num_blocks, 1), (stride, 1), first + span - 1).add_(0)
        finally:
            del base

    # ---------------------------------------------------------------- views

    def create_next_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next ``(num_blocks, tensor_page_size)`` int8 view in this rank's slice.

        Views are packed one after another inside the rank's slice of each row,
        so the row stride (every rank's pages) is the view's first stride.
        """
        self._check_open()
        if self._rank is None:
            raise SharedRegionError(f"{self._path} was opened without a rank; use rows()")
        tensor_page_size = check_int("tensor_page_size", tensor_page_size, minimum=1)
        lay = self._layout
        slice_end = (self._rank + 1) * lay.page_bytes_per_rank
        if self._next_offset + tensor_page_size > slice_end:
            used = self._next_offset - self._rank * lay.page_bytes_per_rank
            raise SharedRegionLayoutError(
                f"a view of {tensor_page_size} bytes per block does not fit rank {self._rank}'s "
                f"slice of {lay.page_bytes_per_rank} bytes ({used} already used, "
                f"{lay.page_bytes_per_rank - used} left)"
            )
        view = torch.as_strided(
            self._base_tensor(),
            (lay.num_blocks, tensor_page_size),
            (self._row_stride, 1),
            self._next_offset,
        )
        self._next_offset += tensor_page_size
        self._views.append(view)
        return view

    def rows(self) -> torch.Tensor:
        """All ranks' pages, one ``(row_stride,)`` int8 row per block."""
        self._check_open()
        shape = (self._layout.num_blocks, self._row_stride)
        return torch.as_strided(self._base_tensor(), shape, (self._row_stride, 1))

    # Raising frames must not hold the base tensor: a caller keeping the
    # exception (and so its traceback) would keep the mapping exported.
    def _check_open(self) -> None:
        if self._closed or self._base is None:
            raise SharedRegionError(f"shared region {self._path} is closed")

    def _base_tensor(self) -> torch.Tensor:
        assert self._base is not None
        return self._base

    # ---------------------------------------------------------------- pinning

    def pin(self, driver: object | None = None) -> None:
        """Register the whole mapping with CUDA as pinned memory (idempotent).

        Pinning is lazy because it faults in and locks every page, every rank's
        included; ``close()`` unregisters before unmapping.
        """
        self._check_open()
        if self._registration is not None:
            return
        pinned = importlib.import_module("aiokvo.memory.pinned")
        ptr = self._base_tensor().data_ptr()
        registration: _Registration = pinned.HostRegistration(ptr, len(self._mmap), driver=driver)
        registration.register()
        self._registration = registration

    @property
    def is_pinned(self) -> bool:
        return self._registration is not None

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Unpin, drop the views, unmap, close, and (creator only) unlink. Idempotent.

        If the caller still holds views, the mapping cannot be unmapped yet: a
        ``ResourceWarning`` says so and the memory stays valid until the last
        view is freed. The file is removed either way.
        """
        if self._closed:
            return
        self._closed = True
        registration, self._registration = self._registration, None
        try:
            if registration is not None:
                registration.unregister()
        finally:
            self._views.clear()
            self._base = None
            self._unmap()
            self._finalizer()

    def _unmap(self) -> None:
        try:
            self._mmap.close()
            return
        except BufferError:
            gc.collect()  # views caught in reference cycles (tracebacks, frames)
        try:
            self._mmap.close()
        except BufferError:
            warnings.warn(
                f"shared region {self._path} closed while views of it are alive; the "
                "mapping is released when the last view is freed",
                ResourceWarning,
                stacklevel=3,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()

    async def aclose(self) -> None:
        self.close()

    # ---------------------------------------------------------------- facts

    @property
    def path(self) -> Path:
        return self._path

    @property
    def directory(self) -> Path:
        """The directory holding the region file and its lock file."""
        return self._directory

    @property
    def is_creator(self) -> bool:
        """True in the process that made the file (and will remove it)."""
        return self._creator

    @property
    def generation(self) -> int:
        """1 for a fresh file, one more each time a stale file was replaced.

        Ranks of one engine can compare it to check they attached to the same file.
        """
        return self._generation

    @property
    def rank(self) -> int | None:
        return self._rank

    @property
    def num_blocks(self) -> int:
        return self._layout.num_blocks

    @property
    def num_workers(self) -> int:
        return self._layout.num_workers

    @property
    def page_bytes_per_rank(self) -> int:
        return self._layout.page_bytes_per_rank

    @property
    def row_stride(self) -> int:
        return self._row_stride

    @property
    def size_bytes(self) -> int:
        """Bytes of the data area (``total_size_bytes``), header excluded."""
        return self._layout.data_bytes

    @property
    def prefault_method(self) -> PrefaultMethod:
        """How the pages were faulted in: ``madvise``, ``touch`` (fallback) or ``none``."""
        return self._prefault_method

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("creator" if self._creator else "attached")
        return (
            f"<SharedOffloadRegion {self._path} rank={self._rank} {state} "
            f"generation={self._generation} {_describe(self._layout)}>"
        )


def _checked_directory(directory: str | os.PathLike[str] | None) -> Path:
    if directory is None:
        return default_directory()
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"directory {str(path)!r} does not exist or is not a directory")
    check_directory(path, error=UnsafeSharedRegionError)
    return path


def _describe(layout: _Layout) -> str:
    return (
        f"num_blocks={layout.num_blocks} num_workers={layout.num_workers} "
        f"page_bytes_per_rank={layout.page_bytes_per_rank} data_bytes={layout.data_bytes} "
        f"header_bytes={layout.header_bytes}"
    )


def _close_orphan(future: asyncio.Future[SharedOffloadRegion]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()
