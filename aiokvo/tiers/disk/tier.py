"""``DiskTier``: a local disk tier below the CPU pool that never serves a wrong byte.

Hand it to the Offloader (``Offloader(config, kv, tiers=[DiskTier(root,
capacity_bytes=..., model_id=...)])``); it joins the pure
:class:`~aiokvo.tiers.disk.state.DiskTierState` (which blocks, admission,
eviction, breaker), the slabs on disk (:mod:`~aiokvo.tiers.disk.slab`) and
the two handlers (:mod:`~aiokvo.tiers.disk.handler`). docs/tiers.md has the
format, the crash and restart rules and the knobs.

Layout: ``root/<fingerprint name>/slab-NNNN.{index,data}``. ``root`` is
created 0700 if missing and must pass the shared-file directory check; the
fingerprint directory is private (0700, ours, not a link).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokvo.errors import ConfigError
from aiokvo.handlers.routes import HandlerRoute
from aiokvo.keys import OffloadKey
from aiokvo.memory.ownership import OwnerIdentity, check_directory, private_directory
from aiokvo.specs import CPULoadStoreSpec, TransferResult
from aiokvo.tiers.base import Tier, TierBinding, TierLoad, TierStatistics, TierStore
from aiokvo.tiers.breaker import CircuitBreaker
from aiokvo.tiers.disk.config import DiskTierConfig, FsyncPolicy
from aiokvo.tiers.disk.files import FileIO, probe_direct
from aiokvo.tiers.disk.format import HEADER_PAGE, MAX_KEY_BYTES, Entry, SlabGeometry
from aiokvo.tiers.disk.handler import DiskTierHandler
from aiokvo.tiers.disk.runs import DEFAULT_MAX_IO_BYTES, DEFAULT_READ_THREADS, IOV_MAX
from aiokvo.tiers.disk.slab import SlabDirectory, SlabFiles
from aiokvo.tiers.disk.spec import DISK_MEDIUM, BlockStatus, DiskLoadStoreSpec
from aiokvo.tiers.disk.state import DiskTierState
from aiokvo.tiers.fingerprint import LayoutFingerprint

__all__ = ["DiskTier", "DiskTierStatistics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierStatistics(TierStatistics):
    """:class:`~aiokvo.tiers.TierStatistics` plus the disk tier's own:

    * where: ``directory`` (the layout directory), ``slab`` (this process's),
      ``slot_bytes``, ``capacity_bytes``, ``used_bytes`` (slots held, ready or
      being written, times ``slot_bytes``), ``direct_io`` (O_DIRECT in use),
      ``fsync``, ``admit_after``;
    * what it found: ``adopted_blocks`` at open, ``foreign_blocks`` other
      processes' blocks indexed now, ``refreshes`` of that index,
      ``damaged_entries`` index entries whose seal failed, ``refused_slabs``
      slabs of another version or layout left alone;
    * ``stale_reads`` reads of another process's block it had replaced (a
      miss, not corruption).
    """

    directory: str = ""
    slab: int = -1
    slot_bytes: int = 0
    capacity_bytes: int = 0
    used_bytes: int = 0
    direct_io: bool = False
    fsync: str = "none"
    admit_after: int = 1
    adopted_blocks: int = 0
    foreign_blocks: int = 0
    refreshes: int = 0
    damaged_entries: int = 0
    refused_slabs: int = 0
    stale_reads: int = 0


class DiskTier(Tier):
    """Blocks of the CPU pool kept in a directory, checksummed, bounded, restart-safe.

    ``capacity_bytes`` bounds this process's files (its slab's index and data
    file together); ``model_id`` and ``dtype`` (default: the engine tensors'
    dtype, as the Offloader saw it) are part of the layout fingerprint.
    ``admit_after`` offers before a block is written; ``fsync`` ``"none"`` or
    ``"commit"`` (a committed block survives a power loss); ``policy`` the
    eviction policy (``"lru"``, ``"arc"``, a module path); ``io_timeout`` each
    transfer's deadline; ``direct_io`` None to probe O_DIRECT, or force it on
    or off; ``refresh_interval`` seconds between looks at other processes'
    slabs (0: only on :meth:`refresh`); ``failure_threshold`` failures in a
    row open the breaker for ``reset_after`` seconds (doubling while trials
    fail); ``max_write_blocks`` CPU blocks pinned by writes in flight at most
    (default half the pool); ``max_io_bytes`` the bytes one system call moves
    when adjacent slots are read or written together (4 MiB; the slot size
    or less: one call per block); ``read_threads`` the reads of one big
    promotion in flight at once (2). ``file_io`` replaces the system calls
    (tests), ``clock`` the breaker's clock.
    """

    medium = DISK_MEDIUM

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        model_id: str,
        dtype: str | None = None,
        admit_after: int = 1,
        fsync: FsyncPolicy = "none",
        policy: str = "lru",
        io_timeout: float = 10.0,
        direct_io: bool | None = None,
        refresh_interval: float = 2.0,
        failure_threshold: int = 3,
        reset_after: float = 5.0,
        max_tracked: int = 64_000,
        max_write_blocks: int | None = None,
        max_io_bytes: int = DEFAULT_MAX_IO_BYTES,
        read_threads: int = DEFAULT_READ_THREADS,
        file_io: FileIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = DiskTierConfig(
            root=os.fspath(root), capacity_bytes=capacity_bytes, model_id=model_id, dtype=dtype,
            admit_after=admit_after, fsync=fsync, policy=policy, io_timeout=io_timeout,
            direct_io=direct_io, refresh_interval=refresh_interval,
            failure_threshold=failure_threshold, reset_after=reset_after,
            max_tracked=max_tracked, max_write_blocks=max_write_blocks,
            max_io_bytes=max_io_bytes, read_threads=read_threads,
        )  # fmt: skip
        if file_io is not None and not isinstance(file_io, FileIO):
            raise ConfigError(f"file_io must be a FileIO, got {file_io!r}")
        self.io_timeout = self.config.io_timeout
        self.max_write_blocks = self.config.max_write_blocks or 0
        self._file_io = file_io or FileIO()
        self._clock = clock
        self._state: DiskTierState | None = None
        self._fingerprint: LayoutFingerprint | None = None
        self._directory: SlabDirectory | None = None
        self._path: Path | None = None
        self._slab_geometry: SlabGeometry | None = None
        self._writer: DiskTierHandler | None = None
        self._reader: DiskTierHandler | None = None
        self._slabs: dict[int, SlabFiles] = {}
        self._tickets: dict[DiskLoadStoreSpec, object] = {}
        self._refresh_task: asyncio.Task[None] | None = None
        self._refresh_lock: asyncio.Lock | None = None
        self._opened = self._closed = False
        self._direct = False
        self._adopted = self._refreshes = self._damaged = self._refused = 0

    @classmethod
    def from_config(cls, config: DiskTierConfig, **options: Any) -> DiskTier:
        """A tier with ``config``'s settings (``options``: ``file_io``, ``clock``)."""
        settings = {f: getattr(config, f) for f in config.__dataclass_fields__}
        return cls(settings.pop("root"), **settings, **options)

    # ------------------------------------------------------------- binding
    @property
    def fingerprint(self) -> LayoutFingerprint:
        """The layout fingerprint (after :meth:`bind`)."""
        if self._fingerprint is None:
            raise ConfigError("the disk tier is not bound to KV caches yet")
        return self._fingerprint

    @property
    def directory(self) -> Path:
        """The layout directory the slabs live in (after :meth:`bind`)."""
        if self._path is None:
            raise ConfigError("the disk tier is not bound to KV caches yet")
        return self._path

    @property
    def state(self) -> DiskTierState:
        """The pure core (after :meth:`open`): read it, don't drive it."""
        if self._state is None:
            raise ConfigError("the disk tier is not open yet")
        return self._state

    def bind(self, binding: TierBinding) -> Sequence[HandlerRoute]:
        if self._fingerprint is not None:
            raise ConfigError(f"{self!r} is already bound; a tier serves one Offloader")
        config = self.config
        fingerprint = LayoutFingerprint.of(
            binding.kv_caches,
            binding.config,
            model_id=config.model_id,
            dtype=config.dtype or binding.dtype or "unspecified",
        )
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
        root = Path(config.root)
        if not root.exists():
            os.makedirs(root, mode=0o700, exist_ok=True)
        check_directory(root)
        path = private_directory(root, fingerprint.name())
        self._slab_geometry = SlabGeometry(fingerprint.digest(), slot_bytes, num_slots)
        self._fingerprint, self._path = fingerprint, path
        pool_blocks = binding.config.num_cpu_blocks
        if not self.max_write_blocks:
            self.max_write_blocks = max(1, pool_blocks // 2)
        common: dict[str, Any] = {
            "fingerprint": fingerprint, "slot_bytes": slot_bytes, "slabs": self._slabs.get,
            "fsync": config.fsync, "io_timeout": config.io_timeout, "file_io": self._file_io,
            "on_overdue": self._overdue, "directory": None,
            "max_io_bytes": config.max_io_bytes, "read_threads": config.read_threads,
        }  # fmt: skip
        self._state = DiskTierState(
            num_slots,
            policy=config.policy,
            admit_after=config.admit_after,
            max_tracked=config.max_tracked,
            breaker=CircuitBreaker(
                failure_threshold=config.failure_threshold,
                reset_after=config.reset_after,
                max_reset_after=max(60.0, config.reset_after),
            ),
            sink=binding.events,
        )
        self._directory = SlabDirectory(
            path,
            self._slab_geometry,
            direct=False,  # decided by the probe in open()
            file_io=self._file_io,
            check_entry=self._entry_fits,
        )
        common["directory"] = self._directory
        self._writer = DiskTierHandler(binding.cpu_tensors, to_disk=True, **common)
        self._reader = DiskTierHandler(binding.cpu_tensors, to_disk=False, **common)
        return [
            (CPULoadStoreSpec, DiskLoadStoreSpec, self._writer),
            (DiskLoadStoreSpec, CPULoadStoreSpec, self._reader),
        ]

    def _entry_fits(self, entry: Entry) -> bool:
        fingerprint = self._fingerprint
        assert fingerprint is not None
        if len(entry.key) < 4 or len(entry.key) > MAX_KEY_BYTES:
            return False
        group = int.from_bytes(entry.key[-4:], "big")
        return group < len(fingerprint.group_refs) and (
            entry.payload_bytes == fingerprint.payload_bytes(group)
        )

    async def open(self) -> None:
        """Take (or create) this process's slab, rebuild its index, index the others'.

        The file work runs on a thread. Idempotent.
        """
        if self._opened:
            return
        state, directory = self._state, self._directory
        if state is None or directory is None:
            raise ConfigError("bind the disk tier before opening it")
        self._opened = True
        self._refresh_lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        want = self.config.direct_io
        self._direct = await loop.run_in_executor(None, probe_direct, directory.path) if (
            want is None
        ) else want  # fmt: skip
        directory.direct = self._direct
        await loop.run_in_executor(None, _remove_dead_probes, directory.path)
        opened = await loop.run_in_executor(None, directory.open_writer)
        files = opened.files
        self._slabs[files.number] = files
        state.slab = files.number
        dropped = state.adopt(opened.entries)
        self._adopted = len(opened.entries) - len(dropped)
        self._damaged += opened.damaged_entries
        self._refused += len(opened.refused_slabs)
        for reason in opened.refused_slabs:
            logger.warning("disk tier: left alone: %s", reason)
        writer = self._writer
        assert writer is not None
        for entry in dropped:
            if entry.slot < state.num_slots:
                writer.run_later(partial_clear(directory, files, entry.slot, entry.generation))
        await self.refresh()
        if self.config.refresh_interval > 0:
            self._refresh_task = loop.create_task(self._refresh_loop())

    async def refresh(self) -> None:
        """Index the blocks other processes' slabs hold now (on a thread)."""
        state, directory = self._state, self._directory
        if state is None or directory is None or self._closed or not self._opened:
            return
        assert self._refresh_lock is not None
        async with self._refresh_lock:
            known = {n: f for n, f in self._slabs.items() if n != state.slab}
            previous = state.foreign()
            found = await asyncio.get_running_loop().run_in_executor(
                None, directory.refresh, state.slab, known, previous
            )
            if self.closed:
                for number, files in found.slabs.items():
                    if number not in known:
                        files.close()
                return
            self._slabs.update(found.slabs)
            state.set_foreign(found.blocks)
            self._refreshes += 1
            self._damaged += found.damaged_entries
            self._refused += len(found.refused_slabs)

    async def _refresh_loop(self) -> None:
        interval = self.config.refresh_interval
        while not self._closed:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except Exception as exc:  # a bad refresh must not end the tier
                logger.warning("disk tier: refresh failed: %r", exc)

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has begun."""
        return self._closed

    # ------------------------------------------------------------- the path
    def lookup_nowait(self, keys: Sequence[OffloadKey]) -> int:
        return self.state.lookup(keys, self._clock())

    def prepare_load(self, keys: Sequence[OffloadKey]) -> TierLoad | None:
        load = self.state.prepare_read(keys, self._clock())
        if load is not None:
            assert isinstance(load.spec, DiskLoadStoreSpec)
            self._tickets[load.spec] = load.state
        return load

    def complete_load(self, load: TierLoad, result: TransferResult) -> list[OffloadKey]:
        spec = load.spec
        assert isinstance(spec, DiskLoadStoreSpec)
        self._tickets.pop(spec, None)
        if result.error is not None and spec.report.error is None:
            # Failed before its job ran (never submitted, or the handler closed).
            for i, status in enumerate(spec.report.status):
                if status is BlockStatus.NOT_RUN:
                    spec.report.fail(i, BlockStatus.NOT_RUN, result.error)
        state = self.state
        good = state.complete_read(
            load, now=self._clock(), nbytes=self._bytes_ok(spec),
            seconds=result.transfer_time or 0.0,
        )  # fmt: skip
        self._clear_removed()
        return good

    def offer(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        return self.state.offer(keys, self._clock())

    def prepare_store(self, keys: Sequence[OffloadKey]) -> TierStore | None:
        store = self.state.prepare_write(keys, self._clock())
        if store is not None:
            assert isinstance(store.spec, DiskLoadStoreSpec)
            self._tickets[store.spec] = store.state
        return store

    def complete_store(self, store: TierStore, result: TransferResult) -> None:
        spec = store.spec
        assert isinstance(spec, DiskLoadStoreSpec)
        self._tickets.pop(spec, None)
        self.state.complete_write(
            store, now=self._clock(), nbytes=self._bytes_ok(spec),
            seconds=result.transfer_time or 0.0,
        )  # fmt: skip

    def _bytes_ok(self, spec: DiskLoadStoreSpec) -> int:
        writer = self._writer
        assert writer is not None
        return sum(
            writer.payload_bytes(key)
            for key, status in zip(spec.keys, spec.report.status, strict=True)
            if status is BlockStatus.OK
        )

    def _overdue(self, spec: DiskLoadStoreSpec) -> None:
        ticket = self._tickets.get(spec)
        if ticket is not None and self._state is not None:
            self._state.note_timeout(ticket, self._clock())

    def _clear_removed(self) -> None:
        state, directory, writer = self._state, self._directory, self._writer
        assert state is not None and directory is not None and writer is not None
        clears = state.take_clears()
        if not clears or writer.closed:
            return
        files = self._slabs.get(state.slab)
        if files is None:
            return
        for slot, generation in clears:
            writer.run_later(partial_clear(directory, files, slot, generation))

    # ----------------------------------------------------------- reporting
    def statistics(self) -> DiskTierStatistics:
        state = self._state
        config = self.config
        if state is None:
            return DiskTierStatistics(
                medium=self.medium, capacity_bytes=config.capacity_bytes, fsync=config.fsync,
                admit_after=config.admit_after,
            )  # fmt: skip
        now = self._clock()
        slots = state.slots.statistics()
        geometry = self._slab_geometry
        assert geometry is not None
        return DiskTierStatistics(
            **state.counters(),
            medium=self.medium,
            capacity_blocks=state.num_slots,
            used_blocks=slots.used_blocks,
            checksum_failures=state.checksum_failures,
            evictions=slots.blocks_evicted,
            removals=state.slots.blocks_removed,
            breaker=state.breaker.statistics(now),
            directory=str(self._path),
            slab=state.slab if self._opened else -1,
            slot_bytes=geometry.slot_bytes,
            capacity_bytes=config.capacity_bytes,
            used_bytes=slots.used_blocks * geometry.slot_bytes,
            direct_io=self._direct and self._writer is not None and self._writer.aligned,
            fsync=config.fsync,
            admit_after=config.admit_after,
            adopted_blocks=self._adopted,
            foreign_blocks=state.foreign_blocks,
            refreshes=self._refreshes,
            damaged_entries=self._damaged,
            refused_slabs=self._refused,
            stale_reads=state.stale_reads,
        )

    # ------------------------------------------------------------- closing
    async def aclose(self) -> None:
        """Stop refreshing and close the slabs (the handlers, owned by the worker,
        must be closed first: the Offloader does so). Idempotent."""
        if self._closed:
            return
        self._closed = True
        task, self._refresh_task = self._refresh_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for handler in (self._writer, self._reader):
            if handler is not None:
                await handler.aclose()
        slabs = list(self._slabs.values())
        self._slabs.clear()
        for files in slabs:
            files.close()

    def __repr__(self) -> str:
        where = self._path or self.config.root
        return f"<DiskTier {where} capacity_bytes={self.config.capacity_bytes}>"


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


def partial_clear(
    directory: SlabDirectory, files: SlabFiles, slot: int, generation: int
) -> Callable[[], object]:
    """A job freeing ``slot`` if its entry still has ``generation``."""
    return lambda: directory.clear_if(files, slot, generation)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _slots_for(capacity_bytes: int, slot_bytes: int) -> int:
    """The most slots whose index and data files fit ``capacity_bytes`` together."""
    from aiokvo.tiers.disk.format import ENTRY_BYTES

    n = max(0, (capacity_bytes - HEADER_PAGE) // (slot_bytes + ENTRY_BYTES))
    while n > 0 and SlabGeometry(b"\0" * 32, slot_bytes, n).index_bytes + n * slot_bytes > (
        capacity_bytes
    ):
        n -= 1
    return n

