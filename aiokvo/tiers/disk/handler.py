"""The disk tier's I/O routes: ``(CPU, DISK)`` writes and ``(DISK, CPU)`` reads.

Each direction is a :class:`~aiokvo.handlers.base.SingleDirectionHandler`
(FIFO, awaitable :class:`~aiokvo.handlers.TransferTask`\\ s, statistics) whose
copies run on its own :class:`~aiokvo.handlers.host.dispatch.DispatchThread`,
so reads (promotions a load waits for) never queue behind write-through.
The loop only checks and enqueues; it never runs a job itself (no
``assist``): a disk can stall, a memory copy cannot.

A block is one slot of the slab's data file, holding a full row of each
canonical tensor its key's group uses, back to back. ``os.pwritev`` and
``os.preadv`` move those rows straight between the CPU pool's pages and the
file (one iovec per tensor, no staging copy), with O_DIRECT when the
filesystem takes it and every pool row is page-aligned, else through the
page cache. Blocks in adjacent slots move in one call of up to
``max_io_bytes`` (a run, :mod:`~aiokvo.tiers.disk.runs`). Writes: clear the
slots' entries, write and checksum each run, (``fsync="commit"``:
``fdatasync``), commit the entries, (``fdatasync``). Reads: read each run and
verify every block's checksum. Every block's
outcome goes in the spec's :class:`~aiokvo.tiers.disk.spec.BlockReport`;
a transfer with any failed block fails with the first error.

Deadlines: a transfer has ``io_timeout`` seconds from submission, queueing
included; a block not started by then is not started (``TIMEOUT``), and a
timer on the loop tells the tier when a transfer is overdue even if a system
call hangs, so its breaker can act while the call is still stuck.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import numpy as np
import torch

from aiokvo.errors import TierChecksumError, TierTimeoutError, TransferSpecError
from aiokvo.handlers.base import Submission
from aiokvo.handlers.host.dispatch import DispatchEvent, DispatchThread
from aiokvo.handlers.task import DEFAULT_MAX_BUFFERED
from aiokvo.keys import OffloadKey, get_offload_group_idx
from aiokvo.plan.rows import check_ids_in_range
from aiokvo.runtime.poller import PollerMode
from aiokvo.specs import CPULoadStoreSpec, TransferSpec
from aiokvo.tiers.disk.config import FsyncPolicy
from aiokvo.tiers.disk.files import DIRECT_ALIGN, FileIO, ShortRead, read_all, write_all
from aiokvo.tiers.disk.format import Entry, checksum
from aiokvo.tiers.disk.runs import (
    DEFAULT_MAX_IO_BYTES,
    DEFAULT_READ_THREADS,
    PARALLEL_READ_MIN_BYTES,
    adjacent_runs,
    shares,
)
from aiokvo.tiers.disk.slab import SlabDirectory, SlabFiles
from aiokvo.tiers.disk.spec import BlockLocation, BlockStatus, DiskLoadStoreSpec
from aiokvo.tiers.fingerprint import LayoutFingerprint
from aiokvo.tiers.io import TierIOHandler

__all__ = ["DiskTierHandler"]

SlabLookup = Callable[[int], "SlabFiles | None"]

OVERLAP_MIN_BYTES = 64 << 10
"""Batches at least this big are checksummed on a helper thread while the next
I/O runs (both release the GIL); smaller ones inline, where handing over
would cost more than it saves."""
VERIFY_BATCH_BYTES = 1 << 20
"""Bytes of blocks gathered before they are handed to the helper thread as one
batch: the hand-off (a future, a wake-up, GIL round trips) then costs per MiB,
not per block, and the last batch, hashed after the last read, stays small."""
Overdue = Callable[[DiskLoadStoreSpec], None]


class DiskTierHandler(TierIOHandler[DiskLoadStoreSpec]):
    """One direction between the CPU pool and a disk tier's slabs.

    ``cpu_tensors`` are the CPU pool's tensors; ``fingerprint`` says which of
    them a key's group uses; ``slabs`` finds a slab's open files by number;
    ``on_overdue`` is called on the loop when a transfer passes its deadline.
    ``dispatcher`` runs the jobs (default: a thread of the handler's own).
    ``max_io_bytes`` bounds one coalesced ``preadv``/``pwritev`` (a block
    alone may be bigger; at most the slot size: one call per block);
    ``read_threads`` how many reads of one big transfer are in flight at once
    (reads only: writes stay one call at a time, in order, so a full disk
    keeps exactly the blocks before the first that did not fit).
    """

    def __init__(
        self,
        cpu_tensors: Sequence[torch.Tensor],
        *,
        fingerprint: LayoutFingerprint,
        slot_bytes: int,
        directory: SlabDirectory,
        slabs: SlabLookup,
        to_disk: bool,
        fsync: FsyncPolicy,
        io_timeout: float,
        file_io: FileIO,
        on_overdue: Overdue,
        dispatcher: DispatchThread | None = None,
        poller_mode: PollerMode | None = None,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_io_bytes: int = DEFAULT_MAX_IO_BYTES,
        read_threads: int = DEFAULT_READ_THREADS,
    ) -> None:
        super().__init__(
            ("CPU", "DISK") if to_disk else ("DISK", "CPU"),
            thread_name="aiokvo-disk-write" if to_disk else "aiokvo-disk-read",
            io_timeout=io_timeout,
            on_overdue=on_overdue,
            dispatcher=dispatcher,
            poller_mode=poller_mode,
            max_buffered=max_buffered,
        )
        self.to_disk = to_disk
        self.fsync = fsync
        self.slot_bytes = slot_bytes
        self.max_io_bytes = max_io_bytes
        self.read_threads = read_threads
        self._io = file_io
        self._directory = directory
        self._slabs = slabs
        self._rows = [t.numpy() for t in cpu_tensors]  # views of the pool: no copy
        self._num_cpu_blocks = min((int(t.shape[0]) for t in cpu_tensors), default=0)
        self._group_tensors = [
            fingerprint.group_tensors(g) for g in range(len(fingerprint.group_refs))
        ]
        self._payload = [fingerprint.payload_bytes(g) for g in range(len(fingerprint.group_refs))]
        # O_DIRECT needs every buffer's address and length aligned: decided once.
        self.aligned = all(_page_aligned(t) for t in cpu_tensors)
        self._helper: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None

    def payload_bytes(self, key: OffloadKey) -> int:
        """Bytes of ``key``'s block (a full pool row of each tensor of its group)."""
        return self._payload[get_offload_group_idx(key)]

    # ------------------------------------------------------------------ submit
    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        src, dst = self._check_route(spec)
        cpu, disk = (src, dst) if self.to_disk else (dst, src)
        if not isinstance(cpu, CPULoadStoreSpec) or not isinstance(disk, DiskLoadStoreSpec):
            raise TransferSpecError(
                f"a disk transfer pairs a CPULoadStoreSpec with a DiskLoadStoreSpec, got {spec!r}"
            )
        n = len(disk)
        if len(cpu) != n:
            raise TransferSpecError(
                f"{n} disk blocks need {n} CPU blocks, got {len(cpu)}"
            )
        check_ids_in_range(cpu.block_ids, self._num_cpu_blocks, "CPU block id", "disk transfer")
        rows = cpu.block_ids.tolist()
        if len(set(rows)) != n:  # two blocks in one row: each would be checked against the other
            raise TransferSpecError(f"a disk transfer names a CPU block twice: {rows}")
        groups = len(self._payload)
        files: list[SlabFiles] = []
        total = 0
        for key, where in zip(disk.keys, disk.locations, strict=True):
            group = get_offload_group_idx(key)
            if group >= groups:
                raise TransferSpecError(
                    f"key {key.hex()} is of KV group {group}; the layout has {groups}"
                )
            slab = self._slabs(where.slab)
            if slab is None or (self.to_disk and not slab.writer):
                raise TransferSpecError(f"slab {where.slab} is not open for this transfer")
            if where.slot >= slab.geometry.num_slots:
                raise TransferSpecError(
                    f"slot {where.slot} is past slab {where.slab}'s {slab.geometry.num_slots}"
                )
            files.append(slab)
            total += self._payload[group]
        deadline = time.monotonic() + self.io_timeout
        job = self._write if self.to_disk else self._read
        return self._dispatch_job(partial(job, disk, rows, files, deadline), disk, total)

    # ------------------------------------------------------------ the jobs
    def _buffers(self, key: OffloadKey, row: int) -> list[np.ndarray]:
        rows = self._rows
        return [rows[t][row] for t in self._group_tensors[get_offload_group_idx(key)]]

    def _fd(self, slab: SlabFiles) -> int:
        direct = slab.direct_fd
        return direct if direct is not None and self.aligned else slab.data_fd

    def _write(
        self, disk: DiskLoadStoreSpec, rows: list[int], files: list[SlabFiles], deadline: float
    ) -> tuple[()]:
        """On the write thread: clear, write, (sync,) commit, (sync).

        Adjacent slots are written in one call (a run, :mod:`~aiokvo.tiers.disk.runs`).
        A block that fails stops the transfer there; the blocks written before
        it are still committed, so a full disk loses only what did not fit (a
        run that fails is written again block by block to find that point).
        """
        io, directory, report, slot_bytes = self._io, self._directory, disk.report, self.slot_bytes
        commit = self.fsync == "commit"
        slabs = _distinct(files)
        locations = disk.locations
        try:
            for slab, where in zip(files, locations, strict=True):
                directory.clear(slab, where.slot)
            if commit:
                for slab in slabs:
                    io.fdatasync(slab.index_fd)
        except OSError as exc:
            for i in range(len(disk.keys)):
                report.fail(i, BlockStatus.IO_ERROR, exc)
            raise
        written: list[int] = []
        sums = _Checksums(self._helper_pool)
        for run in self._runs(range(len(rows)), disk, rows):
            if time.monotonic() > deadline:
                _time_out(report, run[0], "write", self.io_timeout)
                break
            buffers = [self._buffers(disk.keys[i], rows[i]) for i in run]
            sums.add(run, buffers, self._run_bytes(disk, run))  # overlaps the write
            fd = self._fd(files[run[0]])
            if len(run) > 1:
                try:
                    write_all(io, fd, *self._in_file(disk, run, buffers))
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
                    report.fail(i, BlockStatus.IO_ERROR, exc)
                    failed = True
                    break
                written.append(i)
            if failed:
                break
        for i, value in sums.results():
            report.checksums[i] = value
        try:
            if commit and written:
                for slab in slabs:
                    io.fdatasync(slab.data_fd)
            for i in written:
                where, key = locations[i], disk.keys[i]
                directory.commit(
                    files[i], where.slot, key, report.checksums[i], where.generation,
                    self.payload_bytes(key),
                )  # fmt: skip
            if commit and written:
                for slab in slabs:
                    io.fdatasync(slab.index_fd)
        except OSError as exc:
            for i in written:
                report.fail(i, BlockStatus.IO_ERROR, exc)
            raise
        for i in written:
            report.status[i] = BlockStatus.OK
        if report.error is not None:
            raise report.error
        return ()

    def _read(
        self, disk: DiskLoadStoreSpec, rows: list[int], files: list[SlabFiles], deadline: float
    ) -> tuple[()]:
        """On the read thread: read each block into its pool rows and verify it.

        In file order (sequential on the device, whatever order the slots were
        handed out), adjacent slots in one call. With one read thread, checksums
        are computed in batches on the helper thread while the next runs are
        read; with ``read_threads`` > 1 a big transfer's runs are cut into that
        many contiguous shares, read at once (queue depth > 1), each thread
        hashing its own blocks while the others' I/O runs. Returns only once
        every share has finished writing into the pool rows.
        """
        report, locations = disk.report, disk.locations
        order = sorted(range(len(rows)), key=lambda j: (locations[j].slab, locations[j].slot))
        runs = self._runs(order, disk, rows)
        parts = shares(runs, self.read_threads) if self._parallel(disk) else []
        if len(parts) > 1:
            pool = self._read_pool()
            helpers = [
                pool.submit(self._read_runs, disk, rows, files, part, deadline, _Checksums(None))
                for part in parts[1:]
            ]
            try:
                own = _Checksums(None)
                self._read_runs(disk, rows, files, parts[0], deadline, own)
            finally:
                wait(helpers)  # never return while a share may still write into the rows
            found = [*own.results()]
            for helper in helpers:
                found += helper.result().results()
        else:
            sums = _Checksums(self._helper_pool)
            found = list(self._read_runs(disk, rows, files, runs, deadline, sums).results())
        for i, value in found:  # verify every block read
            if value == locations[i].checksum:
                report.status[i] = BlockStatus.OK
            else:
                self._mismatch(disk, files[i], i, value)
        if report.error is not None:
            raise report.error
        return ()

    def _parallel(self, disk: DiskLoadStoreSpec) -> bool:
        """Whether a read is big enough to share between threads (a hand-off costs
        tens of microseconds: small promotions stay on one thread)."""
        return self.read_threads > 1 and self._run_bytes(disk, range(len(disk))) >= (
            PARALLEL_READ_MIN_BYTES
        )

    def _read_runs(
        self, disk: DiskLoadStoreSpec, rows: list[int], files: list[SlabFiles],
        runs: list[list[int]], deadline: float, sums: _Checksums,
    ) -> _Checksums:  # fmt: skip
        """Read ``runs`` (their blocks' checksums go to ``sums``); failures go to the report."""
        io, report, slot_bytes, locations = self._io, disk.report, self.slot_bytes, disk.locations
        for n, run in enumerate(runs):
            if time.monotonic() > deadline:
                for later in runs[n:]:
                    for j in later:
                        _time_out(report, j, "read", self.io_timeout, only=True)
                break
            buffers = [self._buffers(disk.keys[i], rows[i]) for i in run]
            fd = self._fd(files[run[0]])
            if len(run) > 1:
                try:
                    read_all(io, fd, *self._in_file(disk, run, buffers))
                except OSError:
                    pass  # tell which blocks failed, one by one
                else:
                    sums.add(run, buffers, self._run_bytes(disk, run))
                    continue
            read, read_buffers = [], []
            for i, blocks in zip(run, buffers, strict=True):
                try:
                    read_all(io, fd, blocks, locations[i].slot * slot_bytes)
                except ShortRead as exc:
                    report.fail(i, BlockStatus.MISSING, exc)
                    continue
                except OSError as exc:
                    report.fail(i, BlockStatus.IO_ERROR, exc)
                    continue
                read.append(i)
                read_buffers.append(blocks)
            sums.add(read, read_buffers, self._run_bytes(disk, read))
        return sums

    def _mismatch(self, disk: DiskLoadStoreSpec, slab: SlabFiles, i: int, found: int) -> None:
        """Block ``i`` was read and its bytes do not match: corrupt, or replaced by its writer."""
        key, where = disk.keys[i], disk.locations[i]
        status = BlockStatus.CHECKSUM
        if not slab.writer and not _still(self._directory, slab, where):
            status = BlockStatus.STALE  # its writer moved on since our refresh
        disk.report.fail(
            i, status,
            TierChecksumError(
                f"block {key.hex()} in slot {where.slot} of slab {where.slab}: checksum "
                f"{found:#018x}, expected {where.checksum:#018x}"
                + (" (its writer replaced it)" if status is BlockStatus.STALE else "")
            ),
        )  # fmt: skip

    def _runs(
        self, order: Sequence[int], disk: DiskLoadStoreSpec, rows: list[int]
    ) -> list[list[int]]:
        """``order`` cut into runs of adjacent slots (one system call each)."""
        locations = disk.locations
        groups = [get_offload_group_idx(key) for key in disk.keys]
        return adjacent_runs(
            order,
            [where.slab for where in locations],
            [where.slot for where in locations],
            [self._payload[g] for g in groups],
            [len(self._group_tensors[g]) for g in groups],
            slot_bytes=self.slot_bytes,
            max_bytes=self.max_io_bytes,
        )

    def _in_file(
        self, disk: DiskLoadStoreSpec, run: list[int], buffers: list[list[np.ndarray]]
    ) -> tuple[list[np.ndarray], int]:
        """A run's buffers as the file holds them (a descending run reversed), and
        where it starts: the arguments of its one coalesced call."""
        locations = disk.locations
        if locations[run[1]].slot < locations[run[0]].slot:
            return _flat(buffers[::-1]), locations[run[-1]].slot * self.slot_bytes
        return _flat(buffers), locations[run[0]].slot * self.slot_bytes

    def _run_bytes(self, disk: DiskLoadStoreSpec, run: Iterable[int]) -> int:
        payload, keys = self._payload, disk.keys
        return sum(payload[get_offload_group_idx(keys[i])] for i in run)

    def _read_pool(self) -> ThreadPoolExecutor:
        pool = self._readers
        if pool is None:
            pool = self._readers = ThreadPoolExecutor(
                self.read_threads - 1, thread_name_prefix="aiokvo-disk-read-io"
            )
        return pool

    def _helper_pool(self) -> ThreadPoolExecutor:
        helper = self._helper
        if helper is None:
            helper = self._helper = ThreadPoolExecutor(1, thread_name_prefix="aiokvo-disk-sum")
        return helper

    async def _close_backend(self) -> None:
        self._shutdown_dispatcher()
        for pool in (self._helper, self._readers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._rows = []

    def run_later(self, work: Callable[[], object]) -> None:
        """Queue ``work`` on this handler's thread, after the transfers queued now
        (housekeeping: clearing removed blocks' entries). Its errors are dropped."""

        def job() -> tuple[()]:
            with contextlib.suppress(OSError):  # best effort: reads re-check entries
                work()
            return ()

        self._dispatch.submit(job, DispatchEvent())


def _still(directory: SlabDirectory, slab: SlabFiles, where: BlockLocation) -> bool:
    """Whether another process's slab still has the entry we indexed."""
    try:
        entry = directory.entry(slab, where.slot)
    except OSError:
        return False
    return isinstance(entry, Entry) and entry.generation == where.generation


def _checksums(blocks: list[list[np.ndarray]]) -> list[int]:
    return [checksum(buffers) for buffers in blocks]


class _Checksums:
    """One job's blocks to checksum, handed to the helper thread in batches of at
    least :data:`VERIFY_BATCH_BYTES` (one future and one wake-up per batch, not
    per block), each hashed while the job's next I/O runs. A last batch under
    :data:`OVERLAP_MIN_BYTES` is hashed inline, and every batch when ``pool``
    is None (a read share: the other shares' I/O overlaps its hashing)."""

    __slots__ = ("_blocks", "_bytes", "_ids", "_pending", "_pool")

    def __init__(self, pool: Callable[[], ThreadPoolExecutor] | None) -> None:
        self._pool = pool
        self._pending: list[tuple[list[int], list[int] | Future[list[int]]]] = []
        self._ids: list[int] = []
        self._blocks: list[list[np.ndarray]] = []
        self._bytes = 0

    def add(self, ids: list[int], blocks: list[list[np.ndarray]], nbytes: int) -> None:
        self._ids += ids
        self._blocks += blocks
        self._bytes += nbytes
        if self._bytes >= VERIFY_BATCH_BYTES:
            self._hand_off()

    def _hand_off(self) -> None:
        if not self._ids:
            return
        ids, blocks = self._ids, self._blocks
        if self._pool is None or self._bytes < OVERLAP_MIN_BYTES:
            self._pending.append((ids, _checksums(blocks)))
        else:
            self._pending.append((ids, self._pool().submit(_checksums, blocks)))
        self._ids, self._blocks, self._bytes = [], [], 0

    def results(self) -> Iterator[tuple[int, int]]:
        """``(block index, checksum)`` of every block added, in the order added."""
        self._hand_off()
        for ids, pending in self._pending:
            found = pending if isinstance(pending, list) else pending.result()
            yield from zip(ids, found, strict=True)


def _flat(blocks: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [b for buffers in blocks for b in buffers]


def _time_out(report: object, i: int, what: str, timeout: float, *, only: bool = False) -> None:
    """Blocks ``i`` and after (or ``i`` alone) were not started: past the deadline."""
    from aiokvo.tiers.disk.spec import BlockReport

    assert isinstance(report, BlockReport)
    error = TierTimeoutError(f"disk {what} passed its deadline ({timeout} s) before block {i}")
    for j in [i] if only else range(i, len(report.status)):
        report.fail(j, BlockStatus.TIMEOUT, error)


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
