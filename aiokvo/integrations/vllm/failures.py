"""Stores that failed for good, handed from the workers to the manager, across processes.

vLLM's connector has no failure channel (0.32 and 0.33 both assert that
every transfer succeeded), so a worker reports a store that still fails
after its retries as finished, and the manager would make its keys hits.
The worker therefore also records the store's CPU block ids here, before
it reports the job finished; the manager reads them when vLLM completes
the store, and completes those keys as failed, so they are dropped and
never served.

The manager and the workers are often different processes: vLLM runs the
CPU platform, and every engine with more than one GPU, on its multiprocess
executor (the scheduler in the engine-core process, one worker process per
rank). So the path is a file per worker rank in ``/dev/shm/aiokvo-<euid>/``
(owner-only, never through a symbolic link, :mod:`aiokvo.memory.ownership`),
named by the engine id both sides are configured with:

* an 8-byte little-endian count of the records written so far, then
* a ring of ``capacity`` 8-byte records (CPU block ids).

A worker writes the records, then the count (``pwrite``, so both are in the
page cache before ``get_finished`` returns); vLLM passes the completion to
the scheduler after that, so the manager, which reads the count through a
shared mapping (a memory read, no system call, on every completed store),
sees the records of every failed store before it completes it. Unconsumed
records are bounded by the blocks being written at once, which is at most
the pool's size: ``capacity`` is the pool's size, so the ring cannot wrap
over a record not yet read.

The same path serves one process (vLLM's ``UniProcExecutor``, the tests'
engine loop). A failure the manager would still miss (another host) never
serves wrong bytes either: the worker also refuses to load from the blocks
(docs/vllm.md, "Failures").
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Collection, Iterable
from pathlib import Path

from aiokvo._util import check_int
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.memory.ownership import file_identity, open_private

__all__ = ["FailureLog", "StoreFailures", "failure_log_path"]

logger = logging.getLogger(__name__)

_COUNT = struct.Struct("<Q")
_RECORD = 8
_HEADER = mmap.PAGESIZE  # the count sits alone in the first page (the reader maps it)
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")


def failure_log_path(directory: Path, engine_id: str, rank: int) -> Path:
    """The file of worker ``rank`` of engine ``engine_id`` in ``directory``."""
    name = engine_id if _SAFE_NAME.fullmatch(engine_id) else (
        hashlib.sha256(engine_id.encode()).hexdigest()[:32]
    )
    return directory / f"vllm-store-failures-{name}-r{rank}"


class FailureLog:
    """One rank's file: the worker appends (:meth:`append`), the manager reads (:meth:`read_new`).

    ``capacity`` is the ring's size in records (the pool's block count). The
    manager opens its logs with ``owner=True`` when it is built, before any
    store can run: it replaces whatever file has the name (left by a crashed
    engine configured with the same engine id, or an earlier engine of this
    process), and removes its file in :meth:`close`. A worker opens the file
    at its first failure, so it always finds the manager's.
    """

    def __init__(self, path: Path, capacity: int, *, owner: bool = False) -> None:
        self.path = path
        self.capacity = check_int("capacity", capacity, minimum=1)
        self._owner = owner
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._written = self._read = 0
        self._lock = threading.Lock()
        self.lost = 0
        """Records overwritten before they were read (an internal invariant says never)."""
        if owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._open()
            self._map = mmap.mmap(self._fd, _HEADER, prot=mmap.PROT_READ)
            # vLLM does not always shut its scheduler's connector down (an engine
            # core ended by a signal exits without it): remove the file at exit too.
            atexit.register(self.close)

    def _open(self) -> None:
        fd = open_private(self.path, how="either")
        try:
            # Every side sizes the file the same (never shrinking what another wrote);
            # tmpfs keeps it sparse, so only the pages written take memory.
            size = _HEADER + self.capacity * _RECORD
            st = os.fstat(fd)
            if st.st_size not in (0, size):
                raise ConfigError(
                    f"{self.path} holds {st.st_size} bytes, not the {size} of a "
                    f"{self.capacity}-block pool: another engine's under the same engine id"
                )
            if st.st_size == 0:
                os.ftruncate(fd, size)
            self._identity = file_identity(os.fstat(fd))
            self._written = self._read = _COUNT.unpack(os.pread(fd, _COUNT.size, 0))[0]
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    # -- the worker's side ------------------------------------------------------
    def append(self, block_ids: Iterable[int]) -> None:
        """Write ``block_ids``, then publish them by writing the new count."""
        ids = [int(b) for b in block_ids]
        if not ids:
            return
        with self._lock:
            if self._fd < 0:
                self._open()
            count = self._written
            for start in range(0, len(ids), self.capacity):
                chunk = ids[start : start + self.capacity]
                slot = count % self.capacity
                head = chunk[: self.capacity - slot]
                os.pwrite(self._fd, struct.pack(f"<{len(head)}q", *head), _HEADER + slot * _RECORD)
                tail = chunk[len(head) :]
                if tail:
                    os.pwrite(self._fd, struct.pack(f"<{len(tail)}q", *tail), _HEADER)
                count += len(chunk)
            os.pwrite(self._fd, _COUNT.pack(count), 0)
            self._written = count

    # -- the manager's side ---------------------------------------------------------
    def read_new(self) -> list[int]:
        """The block ids written since the last call (none: one memory read)."""
        view = self._map
        if view is None:
            return []
        count = _COUNT.unpack_from(view, 0)[0]
        if count == self._read:
            return []
        with self._lock:
            start, self._read = self._read, count
            if count - start > self.capacity:
                self.lost += count - start - self.capacity
                logger.error(
                    "aiokvo: %d store-failure records in %s were overwritten before they "
                    "were read", count - start - self.capacity, self.path,
                )
                start = count - self.capacity
            out: list[int] = []
            while start < count:
                slot = start % self.capacity
                n = min(count - start, self.capacity - slot)
                data = os.pread(self._fd, n * _RECORD, _HEADER + slot * _RECORD)
                out.extend(struct.unpack(f"<{len(data) // _RECORD}q", data))
                start += n
            return out

    def close(self) -> None:
        """Close the file; the owner also removes it, if the name is still its file."""
        if self._owner:
            atexit.unregister(self.close)
        view, self._map = self._map, None
        if self._fd < 0:
            return
        if view is not None:
            view.close()
        try:
            if self._owner:
                with contextlib.suppress(FileNotFoundError):
                    if file_identity(os.lstat(self.path)) == self._identity:
                        os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = -1


class StoreFailures:
    """The manager's view: CPU block ids whose store failed, until it completes them.

    ``logs`` are the engine's per-rank :class:`FailureLog`\\ s; ``report``
    adds block ids directly (one process, or a test).
    """

    def __init__(self, logs: Collection[FailureLog] = ()) -> None:
        self._logs = tuple(logs)
        self._blocks: set[int] = set()
        self.consumed = 0
        """Keys the manager completed as failed because of a report."""

    @property
    def logs(self) -> tuple[FailureLog, ...]:
        return self._logs

    def report(self, block_ids: Iterable[int]) -> None:
        self._blocks.update(int(b) for b in block_ids)

    def poll(self) -> bool:
        """Read what the workers wrote; True if any failure is waiting to be consumed."""
        for log in self._logs:
            new = log.read_new()
            if new:
                self._blocks.update(new)
        return bool(self._blocks)

    def take(self, manager: CPUOffloadingManager, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        """The ``keys`` being written into a reported block; those reports are consumed.

        A report that outlives its store (a job dropped by a reset) can only
        make a later store into the same block count as failed: a block is
        lost, never a wrong one served.
        """
        failed: list[OffloadKey] = []
        for key in keys:
            status = manager.block_status(key)
            if status is not None and not status.is_ready and status.block_id in self._blocks:
                self._blocks.discard(status.block_id)
                failed.append(key)
        self.consumed += len(failed)
        return failed

    def clear(self) -> None:
        self.poll()  # what was written before the reset is stale: read and dropped
        self._blocks.clear()

    def close(self) -> None:
        for log in self._logs:
            log.close()
