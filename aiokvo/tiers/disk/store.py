"""``DiskStore``: the disk tier's byte I/O over slabs of checksummed slots.

Layout: ``root/<fingerprint name>/slab-NNNN.{index,data}``. ``root`` must be
a directory only this uid (or root) controls, reached without a symbolic
link (created 0700 if missing); the fingerprint directory is private (0700,
ours, not a link). Each process writes its own slab (:mod:`~aiokvo.tiers.
disk.slab`) and reads the others'. Placement is a
:class:`~aiokvo.tiers.slot_index.SlotIndex`.

A block is one slot of the data file holding a full pool row of each
canonical tensor its key's group uses, back to back. ``os.pwritev`` and
``os.preadv`` move those rows straight between the CPU pool's pages and the
file (one iovec per tensor, no staging copy), with O_DIRECT when the
filesystem takes it and every pool row is page-aligned, else through the
page cache. Blocks in adjacent slots move in one call of up to
``max_io_bytes`` (a run, :mod:`~aiokvo.tiers.disk.runs`).

* **Writes**: clear the slots' entries, write and checksum each run
  (hashing overlaps the next run's write), (``fsync="commit"``:
  ``fdatasync``), commit the entries, (``fdatasync``). A block that fails
  stops the transfer there; the blocks before it are still committed, so a
  full disk keeps exactly what fit.
* **Reads**: in file order, each run read and every block's checksum
  verified; a big promotion is read in ``read_threads`` shares at once. A
  block whose bytes do not match is ``CORRUPT`` (or ``STALE`` when another
  process's slot moved on since we indexed it); a file that ends before
  the slot is ``MISSING``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from aiokvo.errors import ConfigError, TierChecksumError, TierTimeoutError, TierUnavailableError
from aiokvo.memory.ownership import OwnerIdentity, private_directory, secure_directory
from aiokvo.tiers.base import TierStatistics
from aiokvo.tiers.checksum import OverlappedChecksums
from aiokvo.tiers.disk.config import DiskTierConfig
from aiokvo.tiers.disk.files import (
    DIRECT_ALIGN,
    FileIO,
    ShortRead,
    probe_direct,
    read_all,
    write_all,
)
from aiokvo.tiers.disk.format import (
    ENTRY_BYTES,
    FREE_ENTRY,
    HEADER_PAGE,
    MAX_KEY_BYTES,
    Entry,
    SlabGeometry,
    pack_entry,
)
from aiokvo.tiers.disk.runs import IOV_MAX, PARALLEL_READ_MIN_BYTES, adjacent_runs, shares
from aiokvo.tiers.disk.slab import SlabDirectory, SlabFiles
from aiokvo.tiers.disk.spec import DISK_MEDIUM
from aiokvo.tiers.index import Index
from aiokvo.tiers.outcome import Outcome, Outcomes
from aiokvo.tiers.slot_index import Adoption, BlockLocation, SlotIndex
from aiokvo.tiers.store import Apply, BlockJob, PoolRows, StoreBinding, StoreCapabilities

__all__ = ["DiskStore", "DiskTierStatistics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierStatistics(TierStatistics):
    """:class:`~aiokvo.tiers.TierStatistics` plus the disk tier's own."""

    directory: str = ""
    """The layout directory the slabs are in."""
    slab: int = -1
    """This process's slab (-1 before open)."""
    slot_bytes: int = 0
    """Bytes of one slot (a block, rounded up to a page)."""
    direct_io: bool = False
    """O_DIRECT in use."""
    fsync: str = "none"
    """The fsync policy."""
    admit_after: int = 1
    """Offers before a block is written."""
    adopted_blocks: int = 0
    """Blocks found in our slab at open (a previous process's)."""
    foreign_blocks: int = 0
    """Other processes' blocks indexed now."""
    refreshes: int = 0
    """Looks at other processes' slabs."""
    damaged_entries: int = 0
    """Index entries whose seal failed (left alone)."""
    refused_slabs: int = 0
    """Slabs of another version or layout left alone."""

    GAUGES: ClassVar[frozenset[str]] = TierStatistics.GAUGES | {
        "slab", "slot_bytes", "foreign_blocks",
    }  # fmt: skip


class DiskStore:
    """The disk tier's store; see the module. ``file_io`` replaces the system calls (tests)."""

    medium = DISK_MEDIUM
    statistics_type: type[TierStatistics] = DiskTierStatistics

    def __init__(self, config: DiskTierConfig, *, file_io: FileIO | None = None) -> None:
        if file_io is not None and not isinstance(file_io, FileIO):
            raise ConfigError(f"file_io must be a FileIO, got {file_io!r}")
        self.config = config
        self.capabilities = StoreCapabilities(maintenance_interval=config.refresh_interval)
        self._io = file_io or FileIO()
        self._rows: PoolRows | None = None
        self._index: SlotIndex | None = None
        self._path: Path | None = None
        self._geometry: SlabGeometry | None = None
        self._directory: SlabDirectory | None = None
        self._slabs: dict[int, SlabFiles] = {}
        self._direct = self._aligned = False
        self._helpers: dict[str, ThreadPoolExecutor] = {}
        self._closed = False
        # close() against open (a control thread) and a refresh's apply (the loop).
        self._lock = threading.Lock()
        self._refreshes = self._damaged = self._refused = 0

    # ------------------------------------------------------------- binding
    @property
    def where(self) -> str:
        return str(self._path or self.config.root)

    @property
    def directory(self) -> Path:
        """The layout directory the slabs live in (after bind)."""
        if self._path is None:
            raise ConfigError("the disk tier is not bound to KV caches yet")
        return self._path

    @property
    def slot_bytes(self) -> int:
        geometry = self._geometry
        return 0 if geometry is None else geometry.slot_bytes

    def row_tail_bytes(self, kv_caches: object, config: object) -> int:
        return 0

    def bind(self, binding: StoreBinding) -> Index:
        config, fingerprint, rows = self.config, binding.fingerprint, binding.rows
        groups = range(len(fingerprint.group_refs))
        widest = max(len(fingerprint.group_tensors(g)) for g in groups)
        if widest > IOV_MAX:  # a block is one preadv/pwritev of one iovec per tensor
            raise ConfigError(
                f"a block of {widest} tensors needs {widest} iovecs; the disk tier moves a "
                f"block in one call, and this system allows {IOV_MAX}"
            )
        payload = max(fingerprint.payload_bytes(g) for g in groups)
        slot_bytes = _round_up(max(payload, 1), HEADER_PAGE)
        num_slots = _slots_for(config.capacity_bytes, slot_bytes)
        if num_slots < 1:
            raise ConfigError(
                f"capacity_bytes={config.capacity_bytes} holds no block: a slot is {slot_bytes} "
                f"bytes and the index needs {2 * HEADER_PAGE}"
            )
        root = secure_directory(Path(config.root))
        path = private_directory(root, fingerprint.name())
        self._geometry = SlabGeometry(fingerprint.digest(), slot_bytes, num_slots)
        self._path, self._rows = path, rows
        self._directory = SlabDirectory(
            path, self._geometry, direct=False, file_io=self._io, check_entry=self._entry_fits
        )
        self._aligned = all(_page_aligned(t) for t in rows.tensors)
        self._index = SlotIndex(
            num_slots, medium=self.medium, policy=config.policy, sink=binding.sink
        )
        return self._index

    def _entry_fits(self, entry: Entry) -> bool:
        rows = self._rows
        assert rows is not None
        if len(entry.key) < 4 or len(entry.key) > MAX_KEY_BYTES:
            return False
        group = int.from_bytes(entry.key[-4:], "big")
        return group < len(rows.payload) and entry.payload_bytes == rows.payload[group]

    # ------------------------------------------------------------- opening
    def open(self) -> Adoption:
        """Take (or create) this process's slab and read its committed entries."""
        directory = self._directory
        if directory is None:
            raise ConfigError("bind the disk tier before opening it")
        want = self.config.direct_io
        self._direct = probe_direct(directory.path) if want is None else want
        directory.direct = self._direct
        _remove_dead_probes(directory.path)
        opened = directory.open_writer()
        files = opened.files
        with self._lock:
            if self._closed:  # closed while we were opening: nobody else will close these
                files.close()
                raise TierUnavailableError("the disk tier was closed while it was opening")
            self._slabs[files.number] = files
        self._damaged += opened.damaged_entries
        self._refused += len(opened.refused_slabs)
        for reason in opened.refused_slabs:
            logger.warning("disk tier: left alone: %s", reason)
        return Adoption(files.number, tuple(opened.entries))

    def maintenance(self, index: Index) -> Callable[[], Apply] | None:
        """Index what other processes' slabs hold now: a refresh (on a thread)."""
        directory = self._directory
        if directory is None or self._closed or not isinstance(index, SlotIndex):
            return None
        own = index.slab
        known = {n: f for n, f in self._slabs.items() if n != own}
        previous = index.foreign()

        def refresh() -> Apply:
            found = directory.refresh(own, known, previous)

            def apply(index: Index) -> None:
                with self._lock:  # the slabs are either close()'s to close, or ours
                    closed = self._closed
                    if not closed:
                        self._slabs.update(found.slabs)
                if closed:
                    for number, files in found.slabs.items():
                        if number not in known:
                            files.close()
                    return
                assert isinstance(index, SlotIndex)
                index.set_foreign(found.blocks)
                self._refreshes += 1
                self._damaged += found.damaged_entries
                self._refused += len(found.refused_slabs)

            return apply

        return refresh

    # ---------------------------------------------------------------- writes
    def write(self, job: BlockJob) -> None:
        """Clear, write, (sync,) commit, (sync); see the module."""
        io, directory, outcomes = self._io, self._live_directory(), job.outcomes
        commit = self.config.fsync == "commit"
        locations: Sequence[BlockLocation] = job.where
        files = self._files(locations, writer=True)
        slabs = _distinct(files)
        slot_bytes = self.slot_bytes
        try:
            for slab in slabs:
                directory.write_entries(slab, [
                    (where.slot, FREE_ENTRY)
                    for f, where in zip(files, locations, strict=True) if f is slab
                ])  # fmt: skip
            if commit:
                for slab in slabs:
                    io.fdatasync(slab.index_fd)
        except OSError as exc:
            outcomes.fail_rest(Outcome.IO_ERROR, exc)
            return
        written: list[int] = []
        rows = self._live_rows()
        sums = OverlappedChecksums(self._helper("write"))
        for run in self._runs(range(len(job)), job):
            if job.late():
                _time_out(outcomes, run[0], "write", self.config.io_timeout)
                break
            buffers = rows.blocks(job.groups, job.rows, run)
            sums.add(run, buffers, self._run_bytes(job, run))  # hashed while the write runs
            fd = self._fd(files[run[0]])
            if len(run) > 1:
                try:
                    write_all(io, fd, *self._in_file(locations, run, buffers))
                except OSError:
                    pass  # find which blocks fit, one by one
                else:
                    written.extend(run)
                    continue
            failed = False
            for i, blocks in zip(run, buffers, strict=True):
                try:
                    write_all(io, fd, blocks, locations[i].slot * slot_bytes)
                except OSError as exc:
                    outcomes.fail(i, Outcome.IO_ERROR, exc)
                    failed = True
                    break
                written.append(i)
            if failed:
                break
        checksums = outcomes.checksums
        for i, value in sums.results():
            checksums[i] = value
        try:
            if commit and written:
                for slab in slabs:
                    io.fdatasync(slab.data_fd)
            for slab in slabs:
                directory.write_entries(slab, [
                    (locations[i].slot, pack_entry(job.keys[i], outcomes.checksums[i],
                                                   locations[i].generation,
                                                   rows.payload[job.groups[i]]))
                    for i in written if files[i] is slab
                ])  # fmt: skip
            if commit and written:
                for slab in slabs:
                    io.fdatasync(slab.index_fd)
        except OSError as exc:
            for i in written:
                outcomes.fail(i, Outcome.IO_ERROR, exc)
            return
        outcomes.ok_all(written)

    # ----------------------------------------------------------------- reads
    def read(self, job: BlockJob) -> None:
        """Read each block into its pool rows and verify it; see the module."""
        outcomes = job.outcomes
        locations: Sequence[BlockLocation] = job.where
        files = self._files(locations, writer=False)
        order = sorted(range(len(job)), key=locations.__getitem__)  # (slab, slot) first
        runs = self._runs(order, job)
        threads = self.config.read_threads
        big = self._run_bytes(job, range(len(job))) >= PARALLEL_READ_MIN_BYTES
        parts = shares(runs, threads) if threads > 1 and big else []
        lane = threading.get_ident()  # each read lane (dispatch thread) has its own helpers
        if len(parts) > 1:
            pool = self._helper(f"read-io-{lane}", threads - 1)()
            helpers = [pool.submit(self._read_verified, job, files, part, OverlappedChecksums(None))
                       for part in parts[1:]]  # fmt: skip
            try:
                good = self._read_verified(job, files, parts[0], OverlappedChecksums(None))
            finally:
                wait(helpers)  # never return while a share may still write into the rows
            for helper in helpers:
                good += helper.result()
        else:
            sums = OverlappedChecksums(self._helper(f"read-{lane}"))
            good = self._read_verified(job, files, runs, sums)
        outcomes.ok_all(good)

    def _read_verified(
        self, job: BlockJob, files: list[SlabFiles], runs: list[list[int]],
        sums: OverlappedChecksums,
    ) -> list[int]:  # fmt: skip
        """Read ``runs`` and verify every block read (a share verifies its own blocks
        while the other shares' reads run); the good blocks, failures to the outcomes."""
        expected: Sequence[BlockLocation] = job.where
        good = []
        for i, value in self._read_runs(job, files, runs, sums).results():
            if value == expected[i].checksum:
                good.append(i)
            else:
                self._mismatch(job, files[i], i, value)
        return good

    def _read_runs(
        self, job: BlockJob, files: list[SlabFiles], runs: list[list[int]],
        sums: OverlappedChecksums,
    ) -> OverlappedChecksums:  # fmt: skip
        """Read ``runs`` (their blocks' checksums go to ``sums``); failures to the outcomes."""
        io, outcomes, slot_bytes = self._io, job.outcomes, self.slot_bytes
        rows = self._live_rows()
        locations: Sequence[BlockLocation] = job.where
        for n, run in enumerate(runs):
            if job.late():
                for later in runs[n:]:
                    for j in later:
                        _time_out(outcomes, j, "read", self.config.io_timeout, only=True)
                break
            buffers = rows.blocks(job.groups, job.rows, run)
            fd = self._fd(files[run[0]])
            if len(run) > 1:
                try:
                    read_all(io, fd, *self._in_file(locations, run, buffers))
                except OSError:
                    pass  # tell which blocks failed, one by one
                else:
                    sums.add(run, buffers, self._run_bytes(job, run))
                    continue
            read, read_buffers = [], []
            for i, blocks in zip(run, buffers, strict=True):
                try:
                    read_all(io, fd, blocks, locations[i].slot * slot_bytes)
                except ShortRead as exc:
                    outcomes.fail(i, Outcome.MISSING, exc)
                    continue
                except OSError as exc:
                    outcomes.fail(i, Outcome.IO_ERROR, exc)
                    continue
                read.append(i)
                read_buffers.append(blocks)
            sums.add(read, read_buffers, self._run_bytes(job, read))
        return sums

    def _mismatch(self, job: BlockJob, slab: SlabFiles, i: int, found: int) -> None:
        """Block ``i`` was read and its bytes do not match: corrupt, or replaced by its writer."""
        key, where = job.keys[i], job.where[i]
        stale = not slab.writer and not _still(self._live_directory(), slab, where)
        job.outcomes.fail(
            i, Outcome.STALE if stale else Outcome.CORRUPT,
            TierChecksumError(
                f"block {key.hex()} in slot {where.slot} of slab {where.slab}: checksum "
                f"{found:#018x}, expected {where.checksum:#018x}"
                + (" (its writer replaced it)" if stale else "")
            ),
        )  # fmt: skip

    # ----------------------------------------------------------- housekeeping
    def remove(self, places: list[Any]) -> None:
        """Free the slots of removed blocks whose entries still have that generation."""
        index, directory = self._index, self._directory
        if index is None or directory is None:
            return
        files = self._slabs.get(index.slab)
        if files is None:
            return
        for slot, generation in places:
            with contextlib.suppress(OSError):  # best effort: reads re-check entries
                directory.clear_if(files, slot, generation)

    def exists(self, places: list[Any]) -> list[int]:
        raise NotImplementedError("a disk tier answers lookups from its index")

    def probe(self) -> bool:
        return True

    def interrupt(self) -> None:
        """Nothing of a control call can hang here for long: nothing to do."""

    def close(self) -> None:
        with self._lock:  # a refresh's slabs are either in _slabs now, or closed by it
            self._closed = True
            slabs = list(self._slabs.values())
            self._slabs.clear()
            pools = list(self._helpers.values())
            self._helpers.clear()
        for pool in pools:
            pool.shutdown(wait=True)
        for files in slabs:
            files.close()

    # ------------------------------------------------------------- reporting
    def statistics_extra(self) -> dict[str, Any]:
        config, index = self.config, self._index
        used = 0 if index is None else index.used_blocks
        return {
            "directory": str(self._path or ""),
            "slab": -1 if index is None or not self._slabs else index.slab,
            "slot_bytes": self.slot_bytes,
            "capacity_bytes": config.capacity_bytes,
            "used_bytes": used * self.slot_bytes,
            "direct_io": self._direct and self._aligned,
            "fsync": config.fsync,
            "admit_after": config.admit_after,
            "refreshes": self._refreshes,
            "damaged_entries": self._damaged,
            "refused_slabs": self._refused,
        }

    # ------------------------------------------------------------- internals
    def _live_rows(self) -> PoolRows:
        rows = self._rows
        assert rows is not None, "bound before any transfer"
        return rows

    def _live_directory(self) -> SlabDirectory:
        directory = self._directory
        assert directory is not None, "bound before any transfer"
        return directory

    def _files(self, locations: Sequence[BlockLocation], *, writer: bool) -> list[SlabFiles]:
        """Each block's open slab (checked: the slab is open, ours for a write, the slot
        inside it)."""
        files = []
        for where in locations:
            slab = self._slabs.get(where.slab)
            if slab is None or (writer and not slab.writer):
                raise OSError(f"slab {where.slab} is not open for this transfer")
            if where.slot >= slab.geometry.num_slots:
                raise OSError(f"slot {where.slot} is past slab {where.slab}'s "
                              f"{slab.geometry.num_slots}")  # fmt: skip
            files.append(slab)
        return files

    def _fd(self, slab: SlabFiles) -> int:
        direct = slab.direct_fd
        return direct if direct is not None and self._aligned else slab.data_fd

    def _runs(self, order: Iterable[int], job: BlockJob) -> list[list[int]]:
        """``order`` cut into runs of adjacent slots (one system call each)."""
        rows = self._live_rows()
        locations: Sequence[BlockLocation] = job.where
        return adjacent_runs(
            list(order),
            [where.slab for where in locations],
            [where.slot for where in locations],
            [rows.payload[g] for g in job.groups],
            [len(rows.group_tensors[g]) for g in job.groups],
            slot_bytes=self.slot_bytes,
            max_bytes=self.config.max_io_bytes,
        )

    def _in_file(
        self, locations: Sequence[BlockLocation], run: list[int], buffers: list[list[memoryview]]
    ) -> tuple[list[memoryview], int]:
        """A run's buffers as the file holds them (a descending run reversed), and
        where it starts: the arguments of its one coalesced call."""
        if locations[run[1]].slot < locations[run[0]].slot:
            return _flat(buffers[::-1]), locations[run[-1]].slot * self.slot_bytes
        return _flat(buffers), locations[run[0]].slot * self.slot_bytes

    def _run_bytes(self, job: BlockJob, run: Sequence[int]) -> int:
        payload, groups = self._live_rows().payload, job.groups
        if len(payload) == 1:
            return payload[0] * len(run)
        return sum(payload[groups[i]] for i in run)

    def _helper(self, role: str, threads: int = 1) -> Callable[[], ThreadPoolExecutor]:
        """A lazily made pool for one role (hashing beside writes, beside reads, read shares).

        Read roles are per read lane: a share that hangs (a bad sector, a stuck device
        queue) then holds up its own request only, never another lane's shares.
        """

        def get() -> ThreadPoolExecutor:
            with self._lock:  # lanes make their pools from their own threads
                pool = self._helpers.get(role)
                if pool is None:
                    name = f"aiokvo-disk-{role}"
                    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
                    self._helpers[role] = pool
            return pool

        return get


def _still(directory: SlabDirectory, slab: SlabFiles, where: BlockLocation) -> bool:
    """Whether another process's slab still has the entry we indexed."""
    try:
        entry = directory.entry(slab, where.slot)
    except OSError:
        return False
    return isinstance(entry, Entry) and entry.generation == where.generation


def _time_out(outcomes: Outcomes, i: int, what: str, timeout: float, *, only: bool = False) -> None:
    """Blocks ``i`` and after (or ``i`` alone) were not started: past the deadline."""
    error = TierTimeoutError(f"disk {what} passed its deadline ({timeout} s) before block {i}")
    for j in [i] if only else range(i, len(outcomes)):
        outcomes.fail(j, Outcome.TIMEOUT, error)


def _flat(blocks: list[list[memoryview]]) -> list[memoryview]:
    return [b for buffers in blocks for b in buffers]


def _distinct(files: list[SlabFiles]) -> list[SlabFiles]:
    return list({id(f): f for f in files}.values())


def _page_aligned(t: torch.Tensor) -> bool:
    """Every row of ``t`` starts and ends on a page boundary (O_DIRECT can use it)."""
    width = int(t.shape[1]) * t.element_size()
    stride = int(t.stride(0)) * t.element_size()
    return (
        t.data_ptr() % DIRECT_ALIGN == 0
        and (t.shape[0] <= 1 or stride % DIRECT_ALIGN == 0)
        and width % DIRECT_ALIGN == 0
    )


def _remove_dead_probes(directory: Path) -> None:
    """Remove O_DIRECT probe files whose process is gone (killed mid-probe)."""
    for name in os.listdir(directory):
        if not name.startswith(".probe-"):
            continue
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):
            continue
        owner = OwnerIdentity.of_process(pid)
        if pid != os.getpid() and (owner is None or not owner.is_alive()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _slots_for(capacity_bytes: int, slot_bytes: int) -> int:
    """The most slots whose index and data files fit ``capacity_bytes`` together."""
    n = max(0, (capacity_bytes - HEADER_PAGE) // (slot_bytes + ENTRY_BYTES))
    while n > 0 and SlabGeometry(b"\0" * 32, slot_bytes, n).index_bytes + n * slot_bytes > (
        capacity_bytes
    ):
        n -= 1
    return n
