"""Slabs on disk: opening this process's own, adopting a dead one's, reading others'.

Blocking file work, run on the tier's threads (never on the loop). The rules
(docs/tiers.md, "Crash and restart"):

* one writer per slab, held by ``flock(LOCK_EX)`` on its index file for the
  writer's lifetime; the kernel drops it when the process dies, however it dies;
* a process opening the tier takes the first slab whose lock is free (its
  writer closed or died) and rebuilds its index from the committed entries;
  if every slab has a live writer it creates the next one;
* a slab whose header is another format version or another layout
  (fingerprint digest, slot size) is never written, adopted or read;
* every file is opened through :mod:`aiokvo.memory.ownership` (no symbolic
  links, owner-only, one name, this uid).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aiokvo.errors import UnsafeFileError
from aiokvo.keys import OffloadKey
from aiokvo.memory.ownership import FileState, OwnerHeader, open_private
from aiokvo.tiers.disk.files import FileIO
from aiokvo.tiers.disk.format import (
    ENTRY_BYTES,
    FREE_ENTRY,
    GEOMETRY_BYTES,
    HEADER_PAGE,
    INDEX_MAGIC,
    Entry,
    SlabGeometry,
    entry_offset,
    pack_entry,
    unpack_entry,
)
from aiokvo.tiers.slot_index import AdoptedEntry, BlockLocation

__all__ = ["OpenedSlab", "Refresh", "SlabDirectory", "SlabFiles"]

_NAME = re.compile(r"slab-(\d{4,9})\.index")

EntryCheck = Callable[[Entry], bool]
"""Whether an entry fits the layout (its key's group, its payload length)."""


@dataclass(eq=False)
class SlabFiles:
    """One slab's open descriptors. ``direct_fd`` is the data file opened with
    O_DIRECT (None where the filesystem refuses it)."""

    number: int
    geometry: SlabGeometry
    index_fd: int
    data_fd: int
    direct_fd: int | None
    writer: bool
    stamp: tuple[int, int, int] = (0, 0, 0)  # index file (inode, size, mtime_ns) when read

    def close(self) -> None:
        for fd in (self.direct_fd, self.data_fd, self.index_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing the index fd also drops the writer's flock
        self.direct_fd = None


@dataclass
class OpenedSlab:
    """What opening the tier found: our slab, its committed entries, and counts."""

    files: SlabFiles
    entries: list[AdoptedEntry]
    adopted_from_previous: bool
    damaged_entries: int = 0
    refused_slabs: list[str] = field(default_factory=list)


@dataclass
class Refresh:
    """What a refresh of the other slabs found."""

    blocks: dict[OffloadKey, BlockLocation]
    slabs: dict[int, SlabFiles]
    damaged_entries: int = 0
    refused_slabs: list[str] = field(default_factory=list)


class SlabDirectory:
    """The slabs of one tier directory (one layout fingerprint).

    ``geometry`` is what this process needs (the digest, slot size and its
    slot count); ``direct`` whether to open data files with O_DIRECT too.
    """

    def __init__(
        self,
        path: Path,
        geometry: SlabGeometry,
        *,
        direct: bool,
        file_io: FileIO,
        check_entry: EntryCheck,
    ) -> None:
        self.path = path
        self.geometry = geometry
        self.direct = direct
        self.io = file_io
        self._check_entry = check_entry

    def paths(self, number: int) -> tuple[Path, Path]:
        return (self.path / f"slab-{number:04d}.index", self.path / f"slab-{number:04d}.data")

    def numbers(self) -> list[int]:
        """Slab numbers present, in order."""
        found = []
        for name in os.listdir(self.path):
            match = _NAME.fullmatch(name)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    # ------------------------------------------------------------- our slab
    def open_writer(self) -> OpenedSlab:
        """Adopt the first slab nobody writes, or create a new one; lock it."""
        refused: list[str] = []
        numbers = self.numbers()
        for number in numbers:
            index_path, _ = self.paths(number)
            try:
                fd = open_private(index_path, how="open")
            except FileNotFoundError:
                continue
            except UnsafeFileError as exc:
                refused.append(str(exc))
                continue
            if not _try_lock(fd):
                os.close(fd)
                continue  # a live writer
            try:
                opened = self._adopt(number, fd, refused)
            except BaseException:
                os.close(fd)
                raise
            if opened is not None:
                opened.refused_slabs = refused
                return opened
            os.close(fd)
        number = numbers[-1] + 1 if numbers else 0
        while True:
            index_path, _ = self.paths(number)
            try:
                fd = open_private(index_path, how="create")
            except FileExistsError:
                number += 1
                continue
            if not _try_lock(fd):  # another opener took our new file for a leftover
                os.close(fd)
                number += 1
                continue
            try:
                files = self._initialise(number, fd, generation=1)
            except BaseException:
                os.close(fd)
                raise
            return OpenedSlab(files, [], adopted_from_previous=False, refused_slabs=refused)

    def _adopt(self, number: int, fd: int, refused: list[str]) -> OpenedSlab | None:
        """Take over slab ``number`` (its lock is ours), or None if it is not ours to take."""
        header, raw = OwnerHeader.read(fd, magic=INDEX_MAGIC, payload_bytes=GEOMETRY_BYTES)
        index_path, _ = self.paths(number)
        if header is None:
            version = OwnerHeader.version_of(raw, magic=INDEX_MAGIC)
            if version is not None and len(raw) >= 16:
                refused.append(f"{index_path}: header format version {version}, not ours")
                return None
            # No header at all: its creator died before writing one. Start it afresh.
            return OpenedSlab(self._initialise(number, fd, generation=1), [], False)
        geometry = SlabGeometry.unpack(header.payload)
        ours = self.geometry
        if (
            geometry is None
            or geometry.digest != ours.digest
            or geometry.slot_bytes != ours.slot_bytes
            or geometry.entry_bytes != ours.entry_bytes
            or geometry.algo != ours.algo
        ):
            refused.append(f"{index_path}: another layout (fingerprint or slot size)")
            return None
        if header.state != FileState.READY:
            return OpenedSlab(self._initialise(number, fd, generation=header.generation + 1), [],
                              False)  # fmt: skip
        entries, damaged = self._read_entries(fd, min(geometry.num_slots, ours.num_slots))
        files = self._open_data(number, fd, writer=True)
        try:
            if geometry.num_slots > ours.num_slots:  # the tier got smaller: drop the rest
                os.ftruncate(files.data_fd, ours.data_bytes)
            os.ftruncate(fd, ours.index_bytes)
            if geometry.num_slots > ours.num_slots:
                tail = ours.num_slots * ENTRY_BYTES
                page_end = HEADER_PAGE + ((tail + HEADER_PAGE - 1) // HEADER_PAGE) * HEADER_PAGE
                os.pwrite(fd, bytes(page_end - HEADER_PAGE - tail), HEADER_PAGE + tail)
            OwnerHeader.create(
                INDEX_MAGIC, generation=header.generation + 1, payload=ours.pack()
            ).ready().write(fd)
        except BaseException:
            files.close()
            raise
        return OpenedSlab(files, entries, adopted_from_previous=True, damaged_entries=damaged)

    def _initialise(self, number: int, fd: int, *, generation: int) -> SlabFiles:
        """Make slab ``number`` an empty slab of our geometry (we hold its lock)."""
        header = OwnerHeader.create(
            INDEX_MAGIC, generation=generation, payload=self.geometry.pack()
        )
        os.ftruncate(fd, 0)
        header.write(fd)
        os.ftruncate(fd, self.geometry.index_bytes)
        files = self._open_data(number, fd, writer=True, create=True)
        try:
            os.ftruncate(files.data_fd, 0)
            header.ready().write(fd)
        except BaseException:
            files.close()
            raise
        return files

    def _open_data(
        self, number: int, index_fd: int, *, writer: bool, create: bool = False
    ) -> SlabFiles:
        _, data_path = self.paths(number)
        data_fd = open_private(data_path, how="either" if create else "open")
        direct_fd = None
        try:
            if self.direct:
                direct_fd = open_private(data_path, how="open", flags=os.O_DIRECT)
        except BaseException:
            os.close(data_fd)
            raise
        return SlabFiles(number, self.geometry, index_fd, data_fd, direct_fd, writer)

    def _read_entries(self, fd: int, num_slots: int) -> tuple[list[AdoptedEntry], int]:
        """The committed entries of ``num_slots`` slots (and how many are damaged).

        The cost follows the entries written, not the capacity: the index file
        is sparse until slots are used, so only its data extents are read
        (``SEEK_DATA`` / ``SEEK_HOLE``), in chunks, and free entries are skipped
        by one numpy pass per chunk before any is unpacked.
        """
        entries: list[AdoptedEntry] = []
        damaged = 0
        check = self._check_entry
        end = HEADER_PAGE + num_slots * ENTRY_BYTES
        for start, stop in _data_extents(fd, HEADER_PAGE, end):
            # Whole entries only: an extent's edges need not fall on entry boundaries.
            lo = HEADER_PAGE + (start - HEADER_PAGE) // ENTRY_BYTES * ENTRY_BYTES
            hi = min(end, HEADER_PAGE + -(-(stop - HEADER_PAGE) // ENTRY_BYTES) * ENTRY_BYTES)
            for at in range(lo, hi, _READ_CHUNK):
                raw = os.pread(fd, min(_READ_CHUNK, hi - at), at)
                table = np.frombuffer(raw, dtype=np.uint8)
                table = table[: len(table) // ENTRY_BYTES * ENTRY_BYTES].reshape(-1, ENTRY_BYTES)
                first = (at - HEADER_PAGE) // ENTRY_BYTES
                for row in np.flatnonzero(table.any(axis=1)).tolist():
                    entry = unpack_entry(table[row].tobytes())
                    slot = first + row
                    if isinstance(entry, Entry) and check(entry):
                        entries.append(
                            AdoptedEntry(slot, entry.key, entry.checksum, entry.generation)
                        )
                    elif entry is not None:
                        damaged += 1
        return entries, damaged

    # ------------------------------------------------------------ writing
    def commit(self, files: SlabFiles, slot: int, key: OffloadKey, checksum: int, generation: int,
               payload_bytes: int) -> None:  # fmt: skip
        """Commit ``key`` in ``slot`` (its payload is written)."""
        self.io.pwrite(
            files.index_fd, pack_entry(key, checksum, generation, payload_bytes),
            entry_offset(slot),
        )  # fmt: skip

    def clear(self, files: SlabFiles, slot: int) -> None:
        """Mark ``slot`` free (before its payload is overwritten)."""
        self.io.pwrite(files.index_fd, FREE_ENTRY, entry_offset(slot))

    def write_entries(self, files: SlabFiles, entries: Sequence[tuple[int, bytes]]) -> None:
        """Write ``(slot, packed entry)`` pairs (commits, or :data:`FREE_ENTRY` to clear),
        the entries of adjacent slots in one ``pwrite``: a transfer's slots are mostly
        runs, so this is a few system calls, not one per block. Each entry is sealed on
        its own, so a write torn by a crash leaves every entry whole or damaged."""
        ordered = sorted(entries, key=lambda e: e[0])
        fd, io = files.index_fd, self.io
        lo = 0
        while lo < len(ordered):
            hi = lo + 1
            while (
                hi < len(ordered) and hi - lo < _ENTRIES_PER_WRITE
                and ordered[hi][0] == ordered[hi - 1][0] + 1
            ):  # fmt: skip
                hi += 1
            data = b"".join(entry for _, entry in ordered[lo:hi])
            offset, done = entry_offset(ordered[lo][0]), 0
            while done < len(data):  # rare: a signal, or a filesystem writing in pieces
                wrote = io.pwrite(fd, data[done:] if done else data, offset + done)
                if wrote <= 0:
                    raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
                done += wrote
            lo = hi

    def clear_if(self, files: SlabFiles, slot: int, generation: int) -> bool:
        """Free ``slot`` if its entry still has ``generation`` (a removed block's)."""
        entry = unpack_entry(self.io.pread(files.index_fd, ENTRY_BYTES, entry_offset(slot)))
        if isinstance(entry, Entry) and entry.generation == generation:
            self.clear(files, slot)
            return True
        return False

    def entry(self, files: SlabFiles, slot: int) -> Entry | bool | None:
        """The entry of ``slot`` now (for telling a stale block from a corrupt one)."""
        return unpack_entry(self.io.pread(files.index_fd, ENTRY_BYTES, entry_offset(slot)))

    # -------------------------------------------------------- other slabs
    def refresh(self, own: int, known: dict[int, SlabFiles],
                previous: dict[OffloadKey, BlockLocation]) -> Refresh:  # fmt: skip
        """Index every other slab's committed blocks (re-reading only changed ones).

        ``known`` are the other slabs opened before (kept open: a read may be
        using them); ``previous`` the blocks found last time.
        """
        slabs = dict(known)
        blocks: dict[OffloadKey, BlockLocation] = {}
        refused: list[str] = []
        damaged = 0
        by_slab: dict[int, dict[OffloadKey, BlockLocation]] = {}
        for key, where in previous.items():
            by_slab.setdefault(where.slab, {})[key] = where
        for number in self.numbers():
            if number == own:
                continue
            index_path, _ = self.paths(number)
            files = slabs.get(number)
            try:
                if files is None:
                    fd = open_private(index_path, how="open")
                    try:
                        header, _ = OwnerHeader.read(
                            fd, magic=INDEX_MAGIC, payload_bytes=GEOMETRY_BYTES
                        )
                        geometry = None if header is None else SlabGeometry.unpack(header.payload)
                        if (
                            header is None
                            or header.state != FileState.READY
                            or geometry is None
                            or geometry.digest != self.geometry.digest
                            or geometry.slot_bytes != self.geometry.slot_bytes
                        ):
                            refused.append(f"{index_path}: not a ready slab of this layout")
                            os.close(fd)
                            continue
                        files = self._open_data(number, fd, writer=False)
                    except BaseException:
                        if files is None:
                            with contextlib.suppress(OSError):
                                os.close(fd)
                        raise
                    files.geometry = geometry
                    slabs[number] = files
                st = os.fstat(files.index_fd)
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
                if stamp == files.stamp and number in by_slab:
                    blocks.update(by_slab[number])
                    continue
                header, _ = OwnerHeader.read(
                    files.index_fd, magic=INDEX_MAGIC, payload_bytes=GEOMETRY_BYTES
                )
                geometry = None if header is None else SlabGeometry.unpack(header.payload)
                if geometry is None or geometry.digest != self.geometry.digest:
                    refused.append(f"{index_path}: its header changed to another layout")
                    continue
                files.geometry = geometry
                entries, bad = self._read_entries(files.index_fd, geometry.num_slots)
                damaged += bad
                files.stamp = stamp
                for e in entries:
                    blocks[e.key] = BlockLocation(number, e.slot, e.checksum, e.generation)
            except FileNotFoundError:
                continue
            except UnsafeFileError as exc:
                refused.append(str(exc))
        return Refresh(blocks, slabs, damaged, refused)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


_READ_CHUNK = 1 << 20  # bytes of index read at once (a multiple of ENTRY_BYTES)
_ENTRIES_PER_WRITE = 8192  # entries one pwrite writes at most (1 MiB)


def _data_extents(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``fd`` cut to the ranges that hold data (not holes); the
    whole range where the filesystem cannot tell."""
    extents: list[tuple[int, int]] = []
    at = start
    try:
        while at < end:
            try:
                data = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data past here
                    break
                raise
            if data >= end:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            extents.append((data, hole))
            at = hole
    except OSError:  # SEEK_DATA not supported here: read it all
        return [(start, end)]
    return extents
