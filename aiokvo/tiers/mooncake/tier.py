"""``MooncakeTier``: a distributed tier on Mooncake Store, shared by engine replicas.

Hand it to the Offloader (``Offloader(config, kv, tiers=[MooncakeTier(
"10.0.0.5:50051", model_id=...)])``, or ``{"kind": "mooncake", ...}`` in
``OffloadConfig.from_dict``'s ``tiers``): every engine replica configured
with the same cluster, model and layout finds the blocks the others stored.
It joins the pure :class:`~aiokvo.tiers.mooncake.state.MooncakeTierState`
(index, negative cache, admission, breaker), the guarded client
(:mod:`~aiokvo.tiers.mooncake.client`) and the two handlers
(:mod:`~aiokvo.tiers.mooncake.handler`).

Threads: the handlers' two dispatch threads (puts, gets) and a small pool
of two for control calls (``setup()``, ``batch_is_exist``, removals); the
loop never blocks. Lookups made in the same loop iteration share one
``batch_is_exist`` call.

Liveness: :meth:`open` never fails for an unreachable cluster; the tier
starts disconnected and a background task connects when it can (with
backoff). While disconnected, or while the breaker is open, lookups answer 0
and stores skip the tier: the CPU (and disk) tiers serve on. The breaker's
half-open trial is the tier's own probe (one ``batch_is_exist``), never a
caller's lookup. docs/tiers.md, "Mooncake", has the failure table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from aiokvo.errors import ConfigError, TierUnavailableError
from aiokvo.handlers.pool import padded_row_stride
from aiokvo.handlers.routes import HandlerRoute
from aiokvo.keys import OffloadKey
from aiokvo.specs import CPULoadStoreSpec, TransferResult
from aiokvo.tiers.base import Tier, TierBinding, TierLoad, TierStatistics, TierStore
from aiokvo.tiers.breaker import CircuitBreaker
from aiokvo.tiers.fingerprint import LayoutFingerprint
from aiokvo.tiers.mooncake.client import (
    MooncakeClient,
    StoreFactory,
    apply_env_defaults,
    default_store_factory,
    probe_master,
    route_address,
)
from aiokvo.tiers.mooncake.config import MooncakeTierConfig
from aiokvo.tiers.mooncake.format import TRAILER_BYTES, object_name
from aiokvo.tiers.mooncake.handler import BlockRows, MooncakeTierHandler
from aiokvo.tiers.mooncake.spec import MOONCAKE_MEDIUM, BlockStatus, MooncakeLoadStoreSpec
from aiokvo.tiers.mooncake.state import MooncakeTierState

if TYPE_CHECKING:
    from aiokvo.config import OffloadConfig
    from aiokvo.layout import CanonicalKVCaches

__all__ = ["MooncakeTier", "MooncakeTierStatistics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeTierStatistics(TierStatistics):
    """:class:`~aiokvo.tiers.TierStatistics` plus the Mooncake tier's own.

    ``used_blocks`` counts the blocks this tier has seen in the cluster (its
    index); ``capacity_blocks`` is 0: the cluster owns placement and
    eviction, and ``evictions`` are the cluster's, unseen here.

    * connection: ``connected``, ``master``, ``namespace`` (key prefix and
      layout fingerprint), ``replica_num``, ``setups`` and ``setup_failures``;
    * lookups: ``remote_lookups`` ``batch_is_exist`` calls (lookups of one
      loop iteration share one), ``lookup_failures`` calls that failed or
      passed ``lookup_timeout`` (``lookup_timeouts``), ``negative_hits``
      lookups cut short by the negative cache, ``negative_cached`` keys in it;
    * misses by cause (reads): ``not_found`` (-704: vanished after the
      lookup), ``lease_expired`` (-707), ``transfer_failed`` (-800: its
      segment is unreachable), ``size_mismatches``, ``bad_trailers`` (and
      ``checksum_failures``): each a miss, never data;
    * writes: ``pool_full`` blocks refused with -200 (the cluster had no
      room), ``writing_blocks`` in flight;
    * ``rpc_failures`` transfers whose call failed as a whole (-900/-901, an
      exception); ``removals`` objects with wrong bytes removed from the cluster.
    """

    connected: bool = False
    master: str = ""
    namespace: str = ""
    replica_num: int = 1
    setups: int = 0
    setup_failures: int = 0
    remote_lookups: int = 0
    lookup_failures: int = 0
    lookup_timeouts: int = 0
    negative_hits: int = 0
    negative_cached: int = 0
    not_found: int = 0
    lease_expired: int = 0
    transfer_failed: int = 0
    size_mismatches: int = 0
    bad_trailers: int = 0
    pool_full: int = 0
    writing_blocks: int = 0
    rpc_failures: int = 0


@dataclass(slots=True, eq=False)
class _LookupBatch:
    """Lookups of one loop iteration, answered by one ``batch_is_exist``."""

    future: asyncio.Future[list[int] | None]
    names: list[str] = field(default_factory=list)
    timed_out: bool = False


class MooncakeTier(Tier):
    """Blocks of the CPU pool in a Mooncake cluster, shared by every replica of a model.

    ``master_server_addr`` (``"host:port"``) and ``model_id`` are required; the
    other keywords are :class:`~aiokvo.tiers.mooncake.MooncakeTierConfig`'s.
    ``store_factory`` makes the Mooncake store object (tests pass
    :meth:`FakeMooncakeCluster.store <aiokvo.tiers.mooncake.fake.FakeMooncakeCluster.store>`;
    with one, the master's TCP port is not probed before ``setup()``);
    ``clock`` is the breaker's and the caches' clock.
    """

    medium = MOONCAKE_MEDIUM

    def __init__(
        self,
        master_server_addr: str,
        *,
        model_id: str,
        store_factory: StoreFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        **settings: Any,
    ) -> None:
        self.config = MooncakeTierConfig(
            master_server_addr=master_server_addr, model_id=model_id, **settings
        )
        config = self.config
        self.io_timeout = config.io_timeout
        self.max_write_blocks = config.max_write_blocks or 0
        self._factory = store_factory
        self._clock = clock
        self._client = MooncakeClient(
            store_factory or default_store_factory,
            replica_num=config.replica_num,
            preferred_segment=config.preferred_segment,
            probe=probe_master if store_factory is None else None,
        )
        self._state: MooncakeTierState | None = None
        self._fingerprint: LayoutFingerprint | None = None
        self._namespace = ""
        self._rows: tuple[BlockRows, BlockRows] | None = None
        self._put: MooncakeTierHandler | None = None
        self._get: MooncakeTierHandler | None = None
        self._tickets: dict[MooncakeLoadStoreSpec, object] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._pending: _LookupBatch | None = None
        self._opened = self._closed = False
        self._setups = self._setup_failures = self._lookup_timeouts = self._removals = 0

    @classmethod
    def from_config(cls, config: MooncakeTierConfig, **options: Any) -> MooncakeTier:
        """A tier with ``config``'s settings (``options``: ``store_factory``, ``clock``)."""
        settings = {f.name: getattr(config, f.name) for f in fields(config)}
        return cls(settings.pop("master_server_addr"), model_id=settings.pop("model_id"),
                   **settings, **options)  # fmt: skip

    # ------------------------------------------------------------- binding
    @property
    def fingerprint(self) -> LayoutFingerprint:
        """The layout fingerprint (after :meth:`bind`)."""
        if self._fingerprint is None:
            raise ConfigError("the Mooncake tier is not bound to KV caches yet")
        return self._fingerprint

    @property
    def namespace(self) -> str:
        """``key_prefix/<fingerprint name>``: where this layout's objects live (after bind)."""
        if not self._namespace:
            raise ConfigError("the Mooncake tier is not bound to KV caches yet")
        return self._namespace

    @property
    def state(self) -> MooncakeTierState:
        """The pure core (after :meth:`bind`): read it, don't drive it."""
        if self._state is None:
            raise ConfigError("the Mooncake tier is not bound to KV caches yet")
        return self._state

    @property
    def hostname(self) -> str:
        """This client's segment name in the cluster, once connected."""
        return self._client.hostname

    def object_name(self, key: OffloadKey) -> str:
        """The cluster object that holds ``key``'s block (after :meth:`bind`)."""
        return object_name(self.config.key_prefix, self.fingerprint.name(), key)

    def pool_row_tail_bytes(self, kv_caches: CanonicalKVCaches, config: OffloadConfig) -> int:
        """Room for a trailer after every pool row (``row_trailers``), where every block
        is one canonical tensor (then one buffer per block) and the room costs at most
        1/64 of a row."""
        if not self.config.row_trailers:
            return 0
        groups = kv_caches.group_data_refs
        if any(len({r.tensor_idx for r in refs}) != 1 for refs in groups):
            return 0
        factor = config.block_size_factor
        for tensor in kv_caches.tensors:
            width = tensor.page_size_bytes * factor
            if padded_row_stride(width, TRAILER_BYTES) - width > width // 64:
                return 0
        return TRAILER_BYTES

    def bind(self, binding: TierBinding) -> Sequence[HandlerRoute]:
        if self._fingerprint is not None:
            raise ConfigError(f"{self!r} is already bound; a tier serves one Offloader")
        if self._factory is None:
            _check_installed()
        config = self.config
        fingerprint = LayoutFingerprint.of(
            binding.kv_caches,
            binding.config,
            model_id=config.model_id,
            dtype=config.dtype or binding.dtype or "unspecified",
        )
        blocks = min((int(t.shape[0]) for t in binding.cpu_tensors), default=0)
        tail = binding.row_tail_bytes if config.row_trailers else 0
        in_row = tail >= TRAILER_BYTES  # each row's trailer in the row's room

        def block_rows() -> BlockRows:  # else an arena per direction
            arena = None if in_row else np.zeros((blocks, TRAILER_BYTES), dtype=np.uint8)
            return BlockRows(binding.cpu_tensors, fingerprint, arena, row_tail_bytes=tail)

        rows = (block_rows(), block_rows())
        self._fingerprint, self._rows = fingerprint, rows
        self._namespace = f"{config.key_prefix}/{fingerprint.name()}"
        if not self.max_write_blocks:
            self.max_write_blocks = max(1, binding.config.num_cpu_blocks // 2)
        self._state = MooncakeTierState(
            partial(object_name, config.key_prefix, fingerprint.name()),
            admit_after=config.admit_after,
            max_tracked=config.max_tracked,
            negative_ttl=config.negative_ttl,
            index_ttl=config.index_ttl,
            breaker=CircuitBreaker(
                failure_threshold=config.failure_threshold,
                reset_after=config.reset_after,
                max_reset_after=config.max_reset_after,
            ),
            sink=binding.events,
        )
        common: dict[str, Any] = {
            "io_timeout": config.io_timeout,
            "on_overdue": self._overdue,
            "pipeline_bytes": config.pipeline_bytes,
            "checksum_threads": config.checksum_threads,
        }
        self._put = MooncakeTierHandler(rows[0], self._client, to_cluster=True, **common)
        self._get = MooncakeTierHandler(rows[1], self._client, to_cluster=False, **common)
        return [
            (CPULoadStoreSpec, MooncakeLoadStoreSpec, self._put),
            (MooncakeLoadStoreSpec, CPULoadStoreSpec, self._get),
        ]

    # ------------------------------------------------------------- opening
    async def open(self) -> None:
        """Connect to the cluster (once; idempotent) and watch the connection.

        An unreachable cluster is not an error: the tier stays out of the path
        and keeps trying in the background.
        """
        if self._opened:
            return
        if self._state is None:
            raise ConfigError("bind the Mooncake tier before opening it")
        self._opened = True
        config = self.config
        apply_env_defaults(rpc_timeout=config.effective_rpc_timeout,
                           setup_retries=config.setup_retries)  # fmt: skip
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="aiokvo-mooncake-ctl")
        self._wake = asyncio.Event()
        await self._connect()
        self._monitor_task = asyncio.get_running_loop().create_task(self._monitor())

    async def connect(self) -> bool:
        """Try to connect now (the tier also does so by itself); whether it is connected."""
        if not self._opened or self._closed:
            return False
        return await self._connect()

    async def _connect(self) -> bool:
        state, executor = self._state, self._executor
        assert state is not None and executor is not None
        if self._client.connected:
            state.set_connected(True, self._clock())
            return True
        rows = self._rows
        assert rows is not None
        config = self.config
        spans = rows[0].spans() + rows[1].spans()[-1:]  # the pool once, both arenas
        loop = asyncio.get_running_loop()

        def connect() -> None:  # on a control thread: route_address may resolve a name
            host = config.local_hostname or route_address(config.master_server_addr)
            settings = config.setup_settings(host)
            self._client.connect(settings, spans, probe_timeout=config.lookup_timeout)

        call = loop.run_in_executor(executor, connect)
        try:
            await asyncio.wait_for(asyncio.shield(call), config.setup_timeout)
        except (TierUnavailableError, TimeoutError, OSError) as exc:
            self._setup_failures += 1
            level = logging.WARNING if self._setup_failures == 1 else logging.DEBUG
            logger.log(level, "Mooncake tier: not connected to %s: %s",
                       config.master_server_addr, exc or "setup timed out")  # fmt: skip
            return False
        self._setups += 1
        state.set_connected(True, self._clock())
        state.breaker.record_success(self._clock())
        logger.info("Mooncake tier: connected to %s as %s (namespace %s)",
                    config.master_server_addr, self._client.hostname, self._namespace)  # fmt: skip
        return True

    async def _monitor(self) -> None:
        """Reconnect while disconnected; run the breaker's trial while it is half-open."""
        state, wake = self._state, self._wake
        assert state is not None and wake is not None
        config = self.config
        backoff = config.reset_after
        poll = max(0.005, min(0.25, config.reset_after / 4))
        while not self._closed:
            try:
                now = self._clock()
                if not state.connected:
                    if await self._connect():
                        backoff = config.reset_after
                    else:
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, config.max_reset_after)
                    continue
                if state.needs_probe(now) and state.breaker.acquire(now):
                    ok = await self._probe()
                    state.record_probe(ok, self._clock())
                    continue
                if state.usable(now):
                    wake.clear()
                    await wake.wait()
                else:
                    await asyncio.sleep(poll)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watcher must outlive any one failure
                logger.warning("Mooncake tier: connection watcher: %r", exc)
                await asyncio.sleep(poll)

    async def _probe(self) -> bool:
        executor = self._executor
        assert executor is not None
        loop = asyncio.get_running_loop()
        name = f"{self._namespace}/probe"
        try:
            call = loop.run_in_executor(executor, self._client.exists, [name])
            answers = await asyncio.wait_for(asyncio.shield(call), self.config.lookup_timeout)
        except (TierUnavailableError, TimeoutError, RuntimeError):
            return False
        return len(answers) == 1 and answers[0] in (0, 1)

    def _check_health(self) -> None:
        """Wake the connection watcher if the cluster may not be used now."""
        state, wake = self._state, self._wake
        if wake is not None and state is not None and not state.usable(self._clock()):
            wake.set()

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has begun."""
        return self._closed

    # ------------------------------------------------------------ lookups
    def lookup_nowait(self, keys: Sequence[OffloadKey]) -> int:
        """Leading ``keys`` seen in the cluster within ``index_ttl`` (no call is made)."""
        state, now = self.state, self._clock()
        if not state.usable(now):
            return 0
        n = 0
        for key in keys:
            if not state.is_fresh(key, now) or state.is_negative(key, now):
                break
            n += 1
        return n

    async def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` the cluster holds: one ``batch_is_exist`` (shared
        with the other lookups of this loop iteration), at most ``lookup_timeout``."""
        state = self.state
        if self._closed or not self._opened:
            state.lookups += 1
            state.lookups_bypassed += 1
            return 0
        asked = state.begin_lookup(keys, self._clock())
        if asked is None:
            return 0
        answers: list[int] | None = []
        if asked:
            answers = await self._exists([state.name_of(k) for k in asked])
        found = state.finish_lookup(keys, asked, answers, self._clock())
        self._check_health()
        return found

    async def _exists(self, names: list[str]) -> list[int] | None:
        loop = asyncio.get_running_loop()
        batch = self._pending
        if batch is None:
            batch = self._pending = _LookupBatch(loop.create_future())
            loop.call_soon(self._flush)
        start = len(batch.names)
        batch.names.extend(names)
        try:
            answers = await asyncio.wait_for(
                asyncio.shield(batch.future), self.config.lookup_timeout
            )
        except TimeoutError:
            self._lookup_overdue(batch)  # counted now, whichever timer fired first
            return None
        return None if answers is None else answers[start : start + len(names)]

    def _flush(self) -> None:
        batch, self._pending = self._pending, None
        if batch is None:
            return
        loop = asyncio.get_running_loop()
        executor = self._executor
        try:
            if executor is None or self._closed:
                raise RuntimeError("closed")
            call = loop.run_in_executor(executor, self._client.exists, batch.names)
        except RuntimeError:
            batch.future.set_result(None)
            return
        timer = loop.call_later(self.config.lookup_timeout, self._lookup_overdue, batch)
        call.add_done_callback(partial(self._lookup_done, batch, timer))

    def _lookup_overdue(self, batch: _LookupBatch) -> None:
        if batch.future.done() or batch.timed_out:
            return
        batch.timed_out = True
        self._lookup_timeouts += 1
        self.state.record_lookup_call(False, self._clock())
        self._check_health()

    def _lookup_done(
        self, batch: _LookupBatch, timer: asyncio.TimerHandle, call: asyncio.Future[list[int]]
    ) -> None:
        timer.cancel()
        answers: list[int] | None
        if call.cancelled() or call.exception() is not None:
            answers = None
        else:
            answers = call.result()
            if len(answers) != len(batch.names) or any(a not in (0, 1) for a in answers):
                answers = None
        if not batch.timed_out:
            self.state.record_lookup_call(answers is not None, self._clock())
            self._check_health()
        if not batch.future.done():
            batch.future.set_result(answers)

    # ---------------------------------------------------------------- reads
    def prepare_load(self, keys: Sequence[OffloadKey]) -> TierLoad | None:
        if self._closed:
            return None
        load = self.state.prepare_read(keys, self._clock())
        if load is not None:
            assert isinstance(load.spec, MooncakeLoadStoreSpec)
            self._tickets[load.spec] = load.state
        return load

    def complete_load(self, load: TierLoad, result: TransferResult) -> list[OffloadKey]:
        spec = load.spec
        assert isinstance(spec, MooncakeLoadStoreSpec)
        self._tickets.pop(spec, None)
        _never_ran(spec, result)
        good = self.state.complete_read(
            load, now=self._clock(), nbytes=self._bytes_ok(spec, get=True),
            seconds=result.transfer_time or 0.0,
        )  # fmt: skip
        self._remove_bad()
        self._check_health()
        return good

    def _bytes_ok(self, spec: MooncakeLoadStoreSpec, *, get: bool) -> int:
        """Payload bytes of the blocks of ``spec`` that moved (by the get or put rows' layout)."""
        rows = self._rows
        assert rows is not None
        layout = rows[1] if get else rows[0]
        return sum(
            layout.payload[layout.group_of(k)]
            for k, s in zip(spec.keys, spec.report.status, strict=True)
            if s is BlockStatus.OK
        )

    def _remove_bad(self) -> None:
        names = self.state.take_removals()
        executor = self._executor
        if not names or executor is None or self._closed:
            return
        self._removals += len(names)
        with contextlib.suppress(RuntimeError):  # shutting down
            executor.submit(self._remove_quietly, names)

    def _remove_quietly(self, names: list[str]) -> None:
        try:
            self._client.remove(names)
        except Exception as exc:  # best effort: a later reader verifies again
            logger.debug("Mooncake tier: removing %d bad objects failed: %r", len(names), exc)

    # --------------------------------------------------------------- writes
    def offer(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        if self._closed or not self._opened:
            return []
        return self.state.offer(keys, self._clock())

    def prepare_store(self, keys: Sequence[OffloadKey]) -> TierStore | None:
        if self._closed:
            return None
        store = self.state.prepare_write(keys, self._clock())
        if store is not None:
            assert isinstance(store.spec, MooncakeLoadStoreSpec)
            self._tickets[store.spec] = store.state
        return store

    def complete_store(self, store: TierStore, result: TransferResult) -> None:
        spec = store.spec
        assert isinstance(spec, MooncakeLoadStoreSpec)
        self._tickets.pop(spec, None)
        _never_ran(spec, result)
        self.state.complete_write(
            store, now=self._clock(), nbytes=self._bytes_ok(spec, get=False),
            seconds=result.transfer_time or 0.0,
        )  # fmt: skip
        self._check_health()

    def _overdue(self, spec: MooncakeLoadStoreSpec) -> None:
        ticket = self._tickets.get(spec)
        if ticket is not None and self._state is not None:
            self._state.note_timeout(ticket, self._clock())
            self._check_health()

    # ----------------------------------------------------------- reporting
    def statistics(self) -> MooncakeTierStatistics:
        config = self.config
        state = self._state
        common: dict[str, Any] = {
            "medium": self.medium,
            "master": config.master_server_addr,
            "namespace": self._namespace,
            "replica_num": config.replica_num,
            "setups": self._setups,
            "setup_failures": self._setup_failures,
            "lookup_timeouts": self._lookup_timeouts,
            "removals": self._removals,
        }
        if state is None:
            return MooncakeTierStatistics(**common)
        now = self._clock()
        by = state.by_status
        return MooncakeTierStatistics(
            **common,
            **state.counters(),
            connected=state.connected and not self._closed,
            used_blocks=state.indexed,
            checksum_failures=by[BlockStatus.CHECKSUM],
            breaker=state.breaker.statistics(now),
            remote_lookups=state.remote_lookups,
            lookup_failures=state.lookup_failures,
            negative_hits=state.negative_hits,
            negative_cached=state.negative(now),
            not_found=by[BlockStatus.NOT_FOUND],
            lease_expired=by[BlockStatus.LEASE_EXPIRED],
            transfer_failed=by[BlockStatus.TRANSFER_FAILED],
            size_mismatches=by[BlockStatus.SIZE_MISMATCH],
            bad_trailers=by[BlockStatus.BAD_TRAILER],
            pool_full=by[BlockStatus.NO_SPACE],
            writing_blocks=state.writing,
            rpc_failures=state.rpc_failures,
        )

    # ------------------------------------------------------------- closing
    async def aclose(self) -> None:
        """Stop watching, close the handlers (the Offloader closed them already),
        then close the client once no call runs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        task, self._monitor_task = self._monitor_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for handler in (self._put, self._get):
            if handler is not None:
                await handler.aclose()
        await asyncio.to_thread(self._client.close)
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, True, cancel_futures=True)
        if self._state is not None:
            self._state.set_connected(False, self._clock())

    def __repr__(self) -> str:
        return f"<MooncakeTier {self.config.master_server_addr} {self._namespace or 'unbound'}>"


def _never_ran(spec: MooncakeLoadStoreSpec, result: TransferResult) -> None:
    """A transfer that failed before its call ran (never submitted, handler closed)."""
    error = result.error
    if error is not None and spec.report.error is None:
        spec.report.fail_all(BlockStatus.NOT_RUN, error)


def _check_installed() -> None:
    """A ConfigError now, at bind, if Mooncake cannot be imported (not at first use)."""
    import importlib

    from aiokvo.tiers.mooncake.client import INSTALL_HINT

    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT}; importing it failed: {exc}") from exc
