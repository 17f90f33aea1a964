"""``Offloader``: the one object an async scheduler drives.

The manager, specs and handlers are the seed's contract, but composing them
by hand has four traps: awaiting between a lookup and its pin (the prefix
can be evicted in between), calling ``complete_*`` exactly once even when
the awaiting coroutine is cancelled (and only once the copy has really
ended), passing exactly the keys a store reserved (with their own GPU
blocks), and finding out when a store in flight ends. Each call here does
the whole workflow:

* **look up and pin with no await in between** (``load_prefix``,
  ``pin_prefix``), then copy, then release;
* **reserve, copy exactly the reserved keys, complete exactly that
  reservation** (``store``);
* **every copy finishes itself**: its task's done-callback calls the
  manager's ``complete_*`` once, when the copy has ended, whatever happened to
  the coroutine that awaited it; that coroutine awaits a future of its own
  (:class:`~aiokvo.offloader.inflight.InFlight`) that the callback resolves
  *after* ``complete_*``, so cancelling it cancels the wait and never the copy;
* **stores in flight can be awaited**: each key being written maps to its
  store's future, which ``ready`` and ``load_prefix`` wait on (no polling).

Results are delivered once, to the call that asked: the worker is built with
``max_buffered=0`` by default, so no result is buffered for a stream nobody
reads. Everything runs on the event loop's thread; nothing here blocks.

Tiers (docs/tiers.md): with ``tiers=[...]`` (or ``config.tiers``), a load
whose CPU prefix ends early continues into the tiers, which promote their
blocks into the CPU pool before the prefix is loaded, and stores write
through to the tiers behind their admission filters
(:class:`~aiokvo.offloader.tiered.TierDriver`). Callers change nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from aiokvo._util import AsyncResource, check_int
from aiokvo.config import OffloadConfig
from aiokvo.errors import ConfigError, OffloaderClosedError
from aiokvo.events import EventSubscription
from aiokvo.factory import OffloadingSpecFactory
from aiokvo.handlers.task import TransferTask
from aiokvo.handlers.worker import OffloadingWorker
from aiokvo.keys import OffloadKey, check_keys, key_sequence
from aiokvo.layout import CanonicalKVCaches, EngineKVCaches, KVLayout
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.retention import Retention
from aiokvo.manager.sink import OverflowPolicy
from aiokvo.offloader.blocks import GpuBlockIds, GpuBlocks, GpuGeometry
from aiokvo.offloader.control import CacheControl, Retained
from aiokvo.offloader.inflight import InFlight
from aiokvo.offloader.lease import PrefixLease
from aiokvo.offloader.refusals import PoolPressure, RefusalLog
from aiokvo.offloader.results import OffloaderStatistics, StoreResult
from aiokvo.offloader.tiered import Promotion, TierDriver, positions
from aiokvo.offloading_spec import CPUOffloadingSpec, OffloadingSpec
from aiokvo.runtime.poller import EventPoller
from aiokvo.specs import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    ReqContext,
    StoreReservation,
    TransferResult,
)
from aiokvo.tiers.base import Tier, TierBinding
from aiokvo.tiers.registry import build_tier

__all__ = ["Offloader"]

_POLL_INTERVAL = 0.001
"""Seconds between looks at a store the Offloader did not start (made by hand on
its manager): the only case where it cannot await the store's end."""


class Offloader(AsyncResource):
    """GPU <-> CPU-pool offloading as single awaitable calls that cannot race.

    ``kv_caches`` is a :class:`~aiokvo.CanonicalKVCaches` or the engine's KV
    tensors (canonicalised with ``kv_layout``). The Offloader builds the spec
    ``config`` names (``CPUOffloadingSpec`` by default) and owns it, its
    manager, a worker and the handlers registered with it; ``aclose()`` (or
    ``async with``) lets every copy in flight finish and complete, releases
    leases never loaded, then closes them all. ``handler_options`` go to the
    spec's handlers (``copy_fn``, ``poller_mode``, ...). ``max_buffered`` is
    the worker's bound on results kept for ``worker.get_finished()``: 0 by
    default, because every result already reaches the call that asked.
    ``tiers`` are the tiers below the CPU pool, top first (default: built
    from ``config.tiers``); the Offloader binds, opens and closes them.

    Calls must be made on the loop's thread. See docs/offloader.md.
    """

    def __init__(
        self,
        config: OffloadConfig,
        kv_caches: CanonicalKVCaches | EngineKVCaches,
        *,
        kv_layout: KVLayout = "blocks_first",
        handler_options: Mapping[str, Any] | None = None,
        max_buffered: int = 0,
        tiers: Sequence[Tier] | None = None,
    ) -> None:
        if not isinstance(config, OffloadConfig):
            raise ConfigError(f"config must be an OffloadConfig, got {config!r}")
        max_buffered = check_int("max_buffered", max_buffered, minimum=0)
        tier_list = _tiers(config, tiers)
        kv = (
            kv_caches
            if isinstance(kv_caches, CanonicalKVCaches)
            else CanonicalKVCaches.from_engine(kv_caches, layout=kv_layout)
        )
        spec = OffloadingSpecFactory.create_spec(config)
        if handler_options:
            if not isinstance(spec, CPUOffloadingSpec):
                raise ConfigError(
                    f"handler_options need a CPUOffloadingSpec, but config names {spec!r}"
                )
            spec.handler_options.update(handler_options)
        if tier_list and not isinstance(spec, CPUOffloadingSpec):
            raise ConfigError(f"tiers need a CPUOffloadingSpec, but config names {spec!r}")
        manager = spec.get_manager()
        try:
            # Room after each pool row for the first tier that wants some (its trailer).
            tails = [tier.pool_row_tail_bytes(kv, config) for tier in tier_list]
            owner = next((i for i, tail in enumerate(tails) if tail > 0), None)
            if owner is not None:
                assert isinstance(spec, CPUOffloadingSpec)
                spec.handler_options.setdefault("row_tail_bytes", tails[owner])
            worker = OffloadingWorker(max_buffered=max_buffered)
            for route in spec.get_handlers(kv):
                worker.register_handler(*route)
            driver = None
            if tier_list:
                assert isinstance(spec, CPUOffloadingSpec)
                binding = TierBinding(kv, spec.cpu_tensors, config, manager.sink, kv.dtype)
                room = spec.cpu_row_tail_bytes
                for i, tier in enumerate(tier_list):
                    mine = i == owner and room >= tails[i]
                    tier_binding = replace(binding, row_tail_bytes=room) if mine else binding
                    for route in tier.bind(tier_binding):
                        worker.register_handler(*route)
                backing = getattr(manager, "backing", None)  # promotions skip the reuse filter
                driver = TierDriver(
                    self,
                    tier_list,
                    store_manager=backing if isinstance(backing, OffloadingManager) else manager,
                    pool_blocks=config.num_cpu_blocks,
                )
        except BaseException:
            manager.shutdown()  # the handlers start no thread before their first copy
            raise
        self.config = config
        self.kv_caches = kv
        self._spec = spec
        self._manager = manager
        self._worker = worker
        self._tiers = driver
        pool = getattr(manager, "backing", None)
        pool = pool if isinstance(pool, OffloadingManager) else manager
        retention = None
        set_retention = getattr(pool, "set_retention", None)
        budget = int(config.num_cpu_blocks * config.retention_fraction)
        if set_retention is not None and budget > 0:
            retention = Retention(budget)
            set_retention(retention)
        self._control = CacheControl(self, driver, pool, retention, config.num_cpu_blocks)
        self._geometry = GpuGeometry(kv, spec.block_size_factor)
        self._ctx = ReqContext()
        self._loop: asyncio.AbstractEventLoop | None = None
        # key being written by one of our stores -> that store's copy
        self._writing: dict[OffloadKey, InFlight] = {}
        self._copies: dict[int, InFlight] = {}  # job id -> copy, for every copy in flight
        self._leases: set[PrefixLease] = set()  # leases holding pins, not loading
        self._next_job = 0
        self._closing = False
        self._close_task: asyncio.Future[None] | None = None
        # Counters (plain int adds on the hot path); see OffloaderStatistics.
        self._loads = self._leases_made = self._hit_blocks = self._miss_blocks = 0
        self._blocks_loaded = self._blocks_load_failed = 0
        self._store_waits = self._polled_waits = self._waiters = self._cancelled_waits = 0
        self._stores = self._stores_refused = self._blocks_store_refused = 0
        self._refusals = RefusalLog()
        self._blocks_stored = self._blocks_skipped = 0
        self._blocks_evicted = self._blocks_store_failed = 0
        self._load_transfers = self._load_failures = self._load_bytes = 0
        self._store_transfers = self._store_failures = self._store_bytes = 0
        self._load_seconds = self._store_seconds = 0.0
        self._cpu_hit_blocks = 0
        self._loads_in_flight = self._stores_in_flight = 0
        # Opt-in request recording (aiokvo.lab.record.TraceRecorder): called with each
        # load_prefix/pin_prefix's keys; None (the default) costs one test per call.
        self.recorder: Callable[[Sequence[OffloadKey]], None] | None = None

    # ----------------------------------------------------------------- parts
    @property
    def spec(self) -> OffloadingSpec:
        """The spec this Offloader built and owns."""
        return self._spec

    @property
    def manager(self) -> OffloadingManager:
        """The manager (read its state; driving it by hand bypasses the Offloader)."""
        return self._manager

    @property
    def worker(self) -> OffloadingWorker:
        """The worker that runs the copies (``worker.get_finished()`` needs ``max_buffered``)."""
        return self._worker

    @property
    def block_size_factor(self) -> int:
        """GPU blocks per key."""
        return self._geometry.factor

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has begun."""
        return self._closing

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers below the CPU pool, top first."""
        return () if self._tiers is None else self._tiers.tiers

    async def __aenter__(self) -> Offloader:
        """Opens the tiers (:meth:`open`) before the first call."""
        await self.open()
        return self

    async def open(self) -> None:
        """Open the tiers now, and wait for those that connect to have tried once (a
        Mooncake tier: up to its ``setup_timeout``). The first call, or ``async with``,
        does it otherwise; a first call waits for a connection no longer than a lookup
        may take, so a slow cluster never holds up the CPU pool."""
        if self._tiers is not None:
            await self._tiers.open()
            await self._tiers.connected()

    def subscribe(
        self, *, maxsize: int = 1024, overflow: OverflowPolicy = "drop_oldest"
    ) -> EventSubscription:
        """The manager's event stream (see :meth:`OffloadingManager.subscribe`)."""
        return self._manager.subscribe(maxsize=maxsize, overflow=overflow)

    # ----------------------------------------------------------------- loads
    async def load_prefix(
        self, keys: Iterable[OffloadKey], gpu_block_ids: GpuBlockIds, ctx: ReqContext | None = None
    ) -> int:
        """Load the longest ready prefix of ``keys`` into its GPU blocks; how many keys.

        ``gpu_block_ids`` gives the GPU blocks of every key (``factor`` per
        key, or a ``GPULoadStoreSpec``; see :mod:`aiokvo.offloader.blocks`);
        the first ``n`` keys' blocks are written. The prefix is looked up and
        pinned with no await in between; when a key of it is being written,
        this waits for that store to end and looks again; a store that fails
        ends the prefix at its key. With several groups, ``n`` counts the
        leading positions ready in every group, and ``n`` keys of each group
        are loaded. Returns 0 when the copy fails (the GPU blocks may then
        hold anything). Cancelling the caller cancels the wait, never the copy.
        """
        self._check_open("load_prefix")
        keys = _as_list(keys, "Offloader.load_prefix")
        if self.recorder is not None:
            self.recorder(keys)
        blocks = self._geometry.resolve(len(keys), gpu_block_ids, "load_prefix", distinct=True)
        ctx = self._ctx if ctx is None else ctx
        self._loads += 1
        tiers = self._tiers
        if tiers is not None and not tiers.opened:
            await tiers.open()
            self._check_open("load_prefix")
        limit = len(keys)
        held: list[OffloadKey] = []  # pinned while tiers promote the keys after them
        promotions: list[Promotion] | None = None
        try:
            while True:
                found = self._lookup(keys, blocks, limit, ctx)
                if not isinstance(found, int):
                    limit = await self._wait_for_store(keys, found, limit)
                    self._check_open("load_prefix")
                    continue
                if tiers is None or promotions is not None or found >= limit:
                    break
                # Hold what the pool has (promotions must not evict it), then ask the tiers.
                held = positions(keys, blocks, 0, found)
                if held:
                    self._manager.prepare_load(held, ctx)
                started = await tiers.promote(keys, blocks, found, limit, ctx, held=len(held))
                self._check_open("load_prefix")
                if started is None:  # past a tier's deadline: load what is held
                    promotions = []
                    break
                promotions = started
            n = found
            if blocks.num_groups == 1:
                pinned = keys[:n]
                dst, _ = blocks.prefix(n)
            else:
                dst, indices = blocks.prefix(n)
                assert indices is not None
                pinned = [keys[i] for i in indices]
            self._hit_blocks += len(pinned)
            self._miss_blocks += len(keys) - len(pinned)
            if not pinned:
                return 0
            src = self._manager.prepare_load(pinned, ctx)
            if held:
                held, released = [], held
                self._manager.complete_load(released)  # the new pins cover them
        except BaseException:
            if held:
                self._manager.complete_load(held)
            raise
        self._cpu_hit_blocks += (
            len(pinned) if tiers is None else tiers.count_hits(pinned, promotions or [])
        )
        self._control.used(pinned)
        self._manager.touch(pinned)
        result = await self._wait(self._start_load(pinned, src, dst, None))
        return n if result.success else 0

    def pin_prefix(
        self, keys: Iterable[OffloadKey], ctx: ReqContext | None = None
    ) -> PrefixLease | None:
        """Look up and pin the longest ready prefix of ``keys`` now, in one synchronous call.

        Returns a :class:`PrefixLease` holding the pins (``count`` 0 for a
        miss), or None when the first key that is not ready is being written
        (``await off.ready(keys)`` then ask again). ``keys`` is one flat list;
        for several groups, pin each group's keys separately.
        """
        self._check_open("pin_prefix")
        keys = _as_list(keys, "Offloader.pin_prefix")
        if self.recorder is not None:
            self.recorder(keys)
        ctx = self._ctx if ctx is None else ctx
        n = self._manager.lookup_prefix(keys, ctx)
        if n is None:
            return None
        pinned = keys[:n]
        src = self._manager.prepare_load(pinned, ctx)
        lease = PrefixLease(self, pinned, src)
        if n:
            self._manager.touch(pinned)
            self._leases.add(lease)
            self._leases_made += 1
            self._hit_blocks += n
            self._cpu_hit_blocks += n
            self._control.used(pinned)
        return lease

    # ---------------------------------------------------------------- stores
    async def store(
        self, keys: Iterable[OffloadKey], gpu_block_ids: GpuBlockIds, ctx: ReqContext | None = None
    ) -> StoreResult:
        """Offload ``keys`` from their GPU blocks; what was stored, skipped, evicted, failed.

        Reserves the keys not held yet (evicting if it must), copies exactly
        those from their own GPU blocks, and completes exactly that
        reservation: success makes them readable, failure releases them.
        ``gpu_block_ids`` as for :meth:`load_prefix`. The GPU blocks are read
        until the copy ends: after a cancelled store, ``await drain()``
        before reusing them.
        """
        self._check_open("store")
        keys = _as_list(keys, "Offloader.store")
        blocks = self._geometry.resolve(len(keys), gpu_block_ids, "store")
        ctx = self._ctx if ctx is None else ctx
        self._stores += 1
        if not keys:
            return StoreResult()
        tiers = self._tiers
        if tiers is not None and not tiers.opened:
            await tiers.open()
            self._check_open("store")
        out = self._manager.prepare_store(keys, ctx)
        if out is None:
            refused = tuple(dict.fromkeys(keys))
            self._refused(len(refused))
            return StoreResult(refused=refused)
        self._refusals.room()
        reserved = out.keys_to_store
        evicted = tuple(out.evicted_keys)
        self._blocks_evicted += len(evicted)
        self._control.evicted(evicted)
        later: list[list[OffloadKey]] | None = None
        if tiers is not None:
            admitted = tiers.offer(keys)
            taken = set(reserved)
            tiers.write_ready(admitted, taken)  # held in the pool already: write them now
            if reserved:
                later = [[k for k in a if k in taken] for a in admitted]
        if not reserved:
            held = tuple(dict.fromkeys(keys))
            self._blocks_skipped += len(held)
            return StoreResult(skipped=held, evicted=evicted)
        start = len(keys) - len(reserved)
        # The usual shape: everything new, or a held prefix and a new tail, no key twice.
        tail = reserved == keys[start:] and (start == 0 or len(set(keys)) == len(keys))
        try:
            if tail:
                src = blocks.tail(start)
            else:  # a key listed twice is stored from its first blocks
                position = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))
                src = blocks.select([position[key] for key in reserved])
            task = self._worker.transfer_async(self._job(), (src, out.store_spec))
        except BaseException:
            self._manager.complete_store(out.reservation, success=False)
            self._blocks_store_failed += len(reserved)
            raise
        copy = self._track(task)
        self._writing.update(dict.fromkeys(reserved, copy))
        self._stores_in_flight += 1
        task.add_done_callback(partial(self._store_done, reserved, out.reservation, copy, later))
        skipped: tuple[OffloadKey, ...] = ()
        if tail:
            skipped = tuple(keys[:start])
        else:
            taken = set(reserved)
            skipped = tuple(k for k in dict.fromkeys(keys) if k not in taken)
        self._blocks_skipped += len(skipped)
        result = await self._wait(copy)
        if result.success:
            return StoreResult(stored=tuple(reserved), skipped=skipped, evicted=evicted)
        return StoreResult(skipped=skipped, evicted=evicted, failed=tuple(reserved))

    # --------------------------------------------------------- cache control
    async def prefetch(self, keys: Iterable[OffloadKey], *, deadline: float | None = None) -> int:
        """Promote the longest prefix of ``keys`` found below the CPU pool into it; how
        many leading keys are ready in the pool when it returns.

        No GPU blocks are involved: a later ``load_prefix`` finds the keys in the
        pool (or, if the promotion is still running, waits for it rather than
        reading twice). Stores of the keys in flight are waited for first. Each
        call's reads go to the least busy of the tiers' ``read_slots`` lanes, so a
        slow request does not hold up another's; a miss below costs one lookup.
        Returns by ``deadline`` seconds (None: each tier's ``io_timeout``), with
        what is ready then; promotions still running land later (counted late).
        Cancelling the call cancels only the wait. ``keys`` are one group.
        """
        return await self._control.prefetch(keys, deadline=deadline)

    async def demote(self, keys: Iterable[OffloadKey]) -> int:
        """Make sure ``keys`` are committed in the top tier, then free their CPU blocks;
        how many blocks were freed.

        Keys the tier does not hold are written to it first (past its admission
        filter and write limit: the caller asked), stores of the keys in flight
        are waited for, and keys a load is reading stay in the pool. A paused
        conversation gives its pool room back and comes back from the tier.
        Needs a tier (ConfigError otherwise).
        """
        return await self._control.demote(keys)

    def retain(self, keys: Iterable[OffloadKey], *, priority: int = 0, ttl: float) -> Retained:
        """Retain ``keys`` softly for ``ttl`` seconds: the pool evicts every other block
        first, lower ``priority`` before higher, and never refuses a store for them.

        Retention is bounded by ``config.retention_fraction`` of the pool (a new
        retention past it displaces lower-priority, then older, ones) and works
        under every eviction policy. Keys need not be stored yet. Returns a
        :class:`~aiokvo.offloader.control.Retained`: ``release()`` it, or use it
        with ``with`` / ``async with``.
        """
        return self._control.retain(keys, priority=priority, ttl=ttl)

    async def durable(
        self,
        keys: Iterable[OffloadKey],
        tier: Tier | str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Return once ``keys`` are committed in ``tier`` (a tier or its medium; None:
        the lowest), so another replica can read them; how many are.

        Stores in flight and writes to that tier are waited for; keys in the CPU
        pool the tier lacks (not admitted, or cut by the write limit) are written
        now. Keys neither in the pool nor in the tier cannot be made durable and
        are not counted. After ``timeout`` seconds it returns what is committed
        then (counted); cancelling it cancels only the wait.
        """
        return await self._control.durable(keys, tier, timeout)

    async def ready(self, keys: Iterable[OffloadKey]) -> None:
        """Return once none of ``keys`` is being written by a store of this Offloader.

        Returns at once (without yielding) when none is. Any number of
        coroutines may wait; each is woken when the stores end, successful or
        not. Cancelling a waiter cancels only its wait. A bare key (not in a list)
        raises :class:`~aiokvo.errors.InvalidKeyError`, as in every call taking keys.
        """
        self._check_open("ready")
        keys = key_sequence(keys, "Offloader.ready")  # a bare key would be read as ints
        check_keys(keys, "Offloader.ready")
        writing = self._writing
        if not writing:
            return
        while True:
            stores = {copy for key in keys if (copy := writing.get(key)) is not None}
            if not stores:
                return
            self._waiters += 1
            try:
                await asyncio.wait([copy.ended() for copy in stores])
            finally:
                self._waiters -= 1

    async def drain(self) -> None:
        """Return once every copy in flight now has finished and been completed.

        The GPU blocks of a cancelled call are read or written until its copy
        ends; this is how to know when they are free again. Copies started
        later are not waited for.
        """
        if self._copies:
            await asyncio.wait([copy.ended() for copy in self._copies.values()])

    # ------------------------------------------------------------- lifecycle
    async def aclose(self) -> None:
        """Refuse new calls, let copies in flight finish and complete, then close.

        Leases never loaded are released. Idempotent; concurrent callers all
        wait for the same close, and cancelling one does not stop it.
        """
        if self._close_task is None:
            self._closing = True
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        # Tier writes started by the last stores are copies too: wait for them all, but
        # a tier's for no longer than its deadline (a hung disk or server must not hang
        # shutdown: the tier's handlers then abandon what is still stuck, and count it).
        while self._copies:
            copies = list(self._copies.values())
            memory = [copy.ended() for copy in copies if copy.patience is None]
            if memory:  # GPU <-> CPU copies always end: the GPU blocks depend on it
                await asyncio.wait(memory)
                continue
            deadline = max(copy.patience or 0.0 for copy in copies)
            _, pending = await asyncio.wait([copy.ended() for copy in copies], timeout=deadline)
            if pending:
                break
        for lease in list(self._leases):
            lease.release()
        try:
            await self._worker.aclose()  # the tiers' handlers too
        finally:
            try:
                if self._tiers is not None:
                    await self._tiers.aclose()
            finally:
                await self._spec.aclose()

    def statistics(self) -> OffloaderStatistics:
        """A snapshot of this Offloader and its parts (see :class:`OffloaderStatistics`)."""
        poller = None if self._loop is None else EventPoller.existing(self._loop)
        tiers = self._tiers
        return OffloaderStatistics(
            loads=self._loads,
            leases=self._leases_made,
            active_leases=len(self._leases),
            hit_blocks=self._hit_blocks,
            miss_blocks=self._miss_blocks,
            blocks_loaded=self._blocks_loaded,
            blocks_load_failed=self._blocks_load_failed,
            store_waits=self._store_waits,
            polled_waits=self._polled_waits,
            stores=self._stores,
            stores_refused=self._stores_refused,
            blocks_stored=self._blocks_stored,
            blocks_skipped=self._blocks_skipped,
            blocks_evicted=self._blocks_evicted,
            blocks_store_failed=self._blocks_store_failed,
            blocks_store_refused=self._blocks_store_refused,
            load_transfers=self._load_transfers,
            load_transfer_failures=self._load_failures,
            load_bytes=self._load_bytes,
            load_seconds=self._load_seconds,
            store_transfers=self._store_transfers,
            store_transfer_failures=self._store_failures,
            store_bytes=self._store_bytes,
            store_seconds=self._store_seconds,
            loads_in_flight=self._loads_in_flight,
            stores_in_flight=self._stores_in_flight,
            writing_keys=len(self._writing),
            waiters=self._waiters,
            cancelled_waits=self._cancelled_waits,
            closed=self._closing,
            hits_by_medium=self._hits_by_medium(),
            promotion_timeouts=0 if tiers is None else tiers.promotion_timeouts,
            promotions_no_room=0 if tiers is None else tiers.promotions_no_room,
            tier_writes_skipped=0 if tiers is None else tiers.writes_skipped,
            tiers=() if tiers is None else tiers.statistics(),
            control=self._control.statistics(),
            manager=self._manager.statistics(),
            worker=self._worker.statistics(),
            poller=None if poller is None else poller.statistics(),
        )

    def _hits_by_medium(self) -> dict[str, int]:
        hits = {"CPU": self._cpu_hit_blocks}
        if self._tiers is not None:
            hits.update(self._tiers.hits)
        return hits

    def __repr__(self) -> str:
        state = "closed" if self._closing else f"copies_in_flight={len(self._copies)}"
        return f"<Offloader {type(self._spec).__name__} {state}>"

    # ------------------------------------------------------------- internals
    def _check_open(self, what: str) -> None:
        if self._closing:
            raise OffloaderClosedError(f"the Offloader is closed; {what} was not started")

    def _job(self) -> int:
        self._next_job += 1
        return self._next_job

    def _lookup(
        self, keys: list[OffloadKey], blocks: GpuBlocks, limit: int, ctx: ReqContext
    ) -> int | tuple[int, int]:
        """Ready positions (pinning nothing), or ``(group start, stop)`` of a group whose
        prefix stops at a store in flight."""
        manager = self._manager
        if blocks.num_groups == 1:
            n = manager.lookup_prefix(keys if limit == len(keys) else keys[:limit], ctx)
            return (0, limit) if n is None else n
        ready: int | None = None
        for start, stop in blocks.group_key_ranges():
            if start == stop:
                continue  # a group without keys limits nothing
            stop = min(stop, start + limit)
            n = manager.lookup_prefix(keys[start:stop], ctx)
            if n is None:
                return (start, stop)
            ready = n if ready is None else min(ready, n)
        return 0 if ready is None else ready

    async def _wait_for_store(
        self, keys: list[OffloadKey], group: tuple[int, int], limit: int
    ) -> int:
        """Wait for the store in flight of the first key being written in ``keys[start:stop]``;
        returns the new limit on prefix positions (the key's position if that store failed)."""
        start, stop = group
        writing = self._writing
        for i in range(start, stop):
            copy = writing.get(keys[i])
            if copy is not None:
                break
        else:  # written by someone who did not go through us: nothing to await
            self._polled_waits += 1
            await asyncio.sleep(_POLL_INTERVAL)
            return limit
        self._store_waits += 1
        self._waiters += 1
        ended = copy.ended()
        try:
            await asyncio.wait((ended,), timeout=copy.patience)
        finally:
            self._waiters -= 1
        if not ended.done():  # a tier promotion past its deadline: the prefix ends there
            return min(limit, i - start)
        return limit if ended.result().success else min(limit, i - start)

    def _start_load(
        self,
        keys: list[OffloadKey],
        src: LoadStoreSpec,
        dst: GPULoadStoreSpec,
        lease: PrefixLease | None,
    ) -> InFlight:
        """Submit the copy of pinned ``keys``; it finishes after ``complete_load``.

        If the copy cannot be submitted, the pins are released and the error raised.
        """
        try:
            task = self._worker.transfer_async(self._job(), (src, dst))
        except BaseException:
            self._manager.complete_load(keys)
            if lease is not None:
                self._leases.discard(lease)
                lease._loaded()
            raise
        copy = self._track(task)
        self._loads_in_flight += 1
        if lease is not None:
            self._leases.discard(lease)  # the copy holds the pins now
        task.add_done_callback(partial(self._load_done, keys, copy, lease))
        return copy

    def _release_lease(self, lease: PrefixLease) -> None:
        """Give back the pins of a lease that was never loaded."""
        self._leases.discard(lease)
        if lease.keys:
            self._manager.complete_load(lease.keys)

    def _track(self, task: TransferTask) -> InFlight:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        copy = self._copies[task.job_id] = InFlight(loop)
        return copy

    async def _wait(self, copy: InFlight) -> TransferResult:
        """Await the caller's side of a copy (a cancellation stops only this wait)."""
        try:
            return await copy.caller
        except asyncio.CancelledError:
            self._cancelled_waits += 1
            raise

    # Done-callbacks: each runs once, on the loop, when its copy has finished.
    def _load_done(
        self, keys: list[OffloadKey], copy: InFlight, lease: PrefixLease | None, task: TransferTask
    ) -> None:
        result = task.result()
        try:
            self._manager.complete_load(keys)
        except Exception as exc:  # a manager bug must not strand the waiters
            self._report("complete_load", exc)
        finally:
            # Nothing below can raise, so the waiters are always woken.
            if lease is not None:
                lease._loaded()
            self._copies.pop(result.job_id, None)
            self._loads_in_flight -= 1
            self._load_transfers += 1
            if result.success:
                self._blocks_loaded += len(keys)
                self._load_bytes += result.transfer_size or 0
                self._load_seconds += result.transfer_time or 0.0
            else:
                self._blocks_load_failed += len(keys)
                self._load_failures += 1
            copy.finish(result)

    def _store_done(
        self,
        keys: list[OffloadKey],
        reservation: StoreReservation,
        copy: InFlight,
        write_through: list[list[OffloadKey]] | None,
        task: TransferTask,
    ) -> None:
        result = task.result()
        try:
            # By reservation: a stale completion by anyone else can never finish ours.
            self._manager.complete_store(reservation, success=result.success)
        except Exception as exc:  # a manager bug must not strand the waiters
            self._report("complete_store", exc)
        else:
            tiers = self._tiers
            if write_through is not None and result.success and tiers is not None:
                try:  # while the blocks are still known: write them through
                    for tier, admitted in zip(tiers.tiers, write_through, strict=True):
                        if admitted:
                            tiers.write(tier, admitted)
                except Exception as exc:
                    self._report("tier write-through", exc)
        finally:
            # Nothing below can raise, so the waiters are always woken.
            writing = self._writing
            for key in keys:
                writing.pop(key, None)
            self._copies.pop(result.job_id, None)
            self._stores_in_flight -= 1
            self._store_transfers += 1
            if result.success:
                self._blocks_stored += len(keys)
                self._store_bytes += result.transfer_size or 0
                self._store_seconds += result.transfer_time or 0.0
            else:
                self._blocks_store_failed += len(keys)
                self._store_failures += 1
            copy.finish(result)

    def _refused(self, keys: int) -> None:
        """Count a store the pool had no room for, and say why once per burst."""
        self._stores_refused += 1
        self._blocks_store_refused += keys
        self._refusals.refused(keys, self._pool_pressure)

    def _pool_pressure(self) -> PoolPressure:
        manager = self._manager.statistics()
        return PoolPressure(
            num_blocks=manager.num_blocks,
            writing_blocks=manager.writing_blocks,
            pinned_blocks=manager.pinned_blocks,
            pinned_by_tier_writes=0 if self._tiers is None else self._tiers.pinned_by_writes,
            write_limit=0 if self._tiers is None else self._tiers.write_limit,
            stores_in_flight=self._stores_in_flight,
        )

    def _evicted(self, keys: Sequence[OffloadKey]) -> None:
        """The pool evicted ``keys`` for a promotion (stores report theirs inline)."""
        self._control.evicted(keys)

    def _report(self, call: str, error: Exception) -> None:
        loop = self._loop or asyncio.get_running_loop()
        loop.call_exception_handler(
            {"message": f"{self!r}: manager.{call} raised", "exception": error}
        )


def _tiers(config: OffloadConfig, tiers: Sequence[Tier] | None) -> list[Tier]:
    """The tier objects: those given, or built from ``config.tiers`` (not both)."""
    if tiers is None:
        return [build_tier(settings) for settings in config.tiers]
    if isinstance(tiers, Tier) or not isinstance(tiers, Sequence):
        raise ConfigError(f"tiers must be a list of Tier objects, got {tiers!r}")
    if config.tiers:
        raise ConfigError("pass tiers either as Tier objects or in config.tiers, not both")
    for tier in tiers:
        if not isinstance(tier, Tier):
            raise ConfigError(f"tiers entries must be Tier objects, got {tier!r}")
    return list(tiers)


def _as_list(keys: Iterable[OffloadKey], what: str) -> list[OffloadKey]:
    """``keys`` as a list; a bare key (bytes, which iterates as ints) is refused."""
    return keys if type(keys) is list else list(key_sequence(keys, what))
