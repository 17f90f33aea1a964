"""aiokvo's tiers below the CPU pool, for vLLM: run by the manager, on the scheduler's thread.

vLLM's workers see only GPU <-> CPU transfers; everything below the pool
happens in the process that owns the manager (docs/vllm.md, "Tiers", says
why this and not vLLM's own tiering spec). That process maps the CPU pool
too: with tiers configured, the pool is always a
:class:`~aiokvo.memory.shared_region.SharedOffloadRegion` named by the
engine id, which the workers open as their ranks and the manager opens
without one (``rank=None``, every rank's pages of every row).

* **demotion**: a store vLLM completes is offered to each tier (its
  admission filter counts the offer); admitted keys ready in the pool are
  pinned there (a CPU eviction cannot take them meanwhile) and written with
  one ``(CPU, tier)`` transfer, at most ``max_write_blocks`` pinned at once
  per tier;
* **promotion**: a lookup that misses the pool but that a tier's index
  holds answers *pending* (vLLM's ``HIT_PENDING``: the scheduler defers the
  request and asks again next step), and queues the key; at the end of the
  step the queued keys get CPU blocks (reserved as being written, so
  lookups keep answering pending) and one ``(tier, CPU)`` transfer reads
  them in. When it ends, only the keys whose bytes the tier vouches for
  (checksums) become hits; the others are released, and a key whose
  promotion failed answers *miss* from then on (until it is stored again),
  so a request is never deferred forever;
* **remote tiers** (a cluster other engines write, Mooncake): a pool miss
  the tier's index has not seen answers *retry* while the cluster is asked
  on the manager's loop; the next lookup of the key promotes it or misses;
* **hints**: ``kv.durable`` and ``kv.demote`` commit a finished request's
  blocks to a tier past its admission filter and write limit
  (:meth:`SchedulerTiers.commit`); a demote then frees them in the pool.

Nothing here blocks the step: the tiers' I/O runs on their own threads, and
their completions are collected through a private event loop that the
manager pumps (:class:`~aiokvo.runtime.pump.PumpedLoop`) in
``on_schedule_end``, once per engine step, as the worker pumps its own.
``has_pending_work`` keeps the engine stepping while transfers are in
flight. All of this runs on the scheduler's thread, like the manager.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from aiokvo.errors import AiokvoError, ConfigError
from aiokvo.keys import OffloadKey
from aiokvo.specs import ReqContext, TransferResult
from aiokvo.tiers.base import Tier, TierLoad, TierStatistics, TierStore

if TYPE_CHECKING:
    from aiokvo.config import OffloadConfig
    from aiokvo.handlers.sync import SyncOffloadingWorker
    from aiokvo.manager.cpu import CPUOffloadingManager
    from aiokvo.tiers.registry import TierConfig

__all__ = ["Answer", "SchedulerTiers", "SchedulerTierStatistics", "open_scheduler_tiers"]

logger = logging.getLogger("aiokvo.integrations.vllm")

_MAX_REFUSED = 1 << 16  # keys remembered as not promotable (then forgotten, oldest first)

Answer = Literal["pending", "retry", "miss"]


def _is_remote(tier: Tier) -> bool:
    """A tier whose store others write too (Mooncake): its index is not the whole truth."""
    store = getattr(tier, "store", None)
    return bool(getattr(getattr(store, "capabilities", None), "remote", False))


@dataclass(frozen=True, slots=True)
class SchedulerTierStatistics:
    """What only the manager knows about its tiers (each tier counts its own I/O)."""

    hits: int = 0
    """Keys lookups found in a tier (answered pending and queued for promotion)."""
    promotions: int = 0
    """Promotion transfers started."""
    promoted_blocks: int = 0
    """Blocks promotions brought into the CPU pool good."""
    promotion_failures: int = 0
    """Blocks a promotion reserved that did not become hits (bad bytes, I/O, no read)."""
    promotions_no_room: int = 0
    """Promotions not started: the CPU pool had no room for their keys."""
    writes_skipped: int = 0
    """Admitted keys not written: the tier's writes in flight pinned ``max_write_blocks``,
    or the key left the pool before its turn."""
    demoted_blocks: int = 0
    """Blocks freed from the CPU pool once a tier committed them (``kv.demote``)."""
    in_flight: int = 0
    """Tier transfers running now."""


class _Promotion:
    __slots__ = ("load", "reserved", "tier")

    def __init__(self, tier: Tier, reserved: list[OffloadKey], load: TierLoad) -> None:
        self.tier, self.reserved, self.load = tier, reserved, load


class _Write:
    __slots__ = ("asked", "evict", "pinned", "store", "tier")

    def __init__(
        self, tier: Tier, store: TierStore, pinned: list[OffloadKey], *, asked: bool = False,
        evict: bool = False,
    ) -> None:
        self.tier, self.store, self.pinned = tier, store, pinned
        self.asked, self.evict = asked, evict


class SchedulerTiers:
    """The tiers of one vLLM engine, top first, driven by its manager; see the module.

    ``core`` is the CPU manager making the pool's decisions; ``sync`` the
    facade over the worker that holds the tiers' routes, pumped on this
    thread; ``close`` releases what :func:`open_scheduler_tiers` built.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        core: CPUOffloadingManager,
        sync: SyncOffloadingWorker,
        close: Callable[[], None],
    ) -> None:
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self._core = core
        self._sync = sync
        self._close: Callable[[], None] | None = close
        self._queued: dict[OffloadKey, Tier] = {}  # found in a tier, promotion not started
        self._refused: dict[OffloadKey, None] = {}  # promotion failed: a miss from now on
        self._to_write: dict[Tier, dict[OffloadKey, None]] = {t: {} for t in self.tiers}
        self._pinned_by_writes = dict.fromkeys(self.tiers, 0)
        self._writing: dict[Tier, set[OffloadKey]] = {t: set() for t in self.tiers}
        self._jobs: dict[int, _Promotion | _Write] = {}
        # Tiers whose index does not know everything (a cluster other engines write):
        # a pool miss asks them, off the step.
        self._remote = [t for t in self.tiers if _is_remote(t)]
        self._asking: dict[OffloadKey, asyncio.Task[Tier | None]] = {}
        self._answers: dict[OffloadKey, Tier | None] = {}
        # Writes a hint asked for (kv.durable, kv.demote): (tier, keys, evict after).
        self._asked: list[tuple[Tier, list[OffloadKey], bool]] = []
        self._next_job = 0
        self._counts = dict.fromkeys(
            ("hits", "promotions", "promoted_blocks", "promotion_failures",
             "promotions_no_room", "writes_skipped", "demoted_blocks"), 0,
        )  # fmt: skip

    # ------------------------------------------------------------- lookups
    def lookup(self, key: OffloadKey, allowed: Callable[[str], bool] | None = None) -> Answer:
        """Where ``key`` is, the pool having missed it: ``"pending"`` (a tier holds
        it; it is queued for promotion), ``"retry"`` (a remote tier is being asked;
        ask again next step) or ``"miss"``. ``allowed(medium)``: whether the request
        may load from that tier (vLLM 0.33's ``load_tier_filter``)."""
        queued = self._queued.get(key)
        if queued is not None:
            return "pending" if allowed is None or allowed(queued.medium) else "miss"
        if key in self._refused:
            return "miss"
        for tier in self.tiers:
            if allowed is not None and not allowed(tier.medium):
                continue
            if tier.lookup_nowait([key]):
                return self._found(key, tier)
        remote = [t for t in self._remote if allowed is None or allowed(t.medium)]
        if not remote:
            return "miss"
        if key in self._answers:
            holder = self._answers.pop(key)
            if holder is not None and holder in remote:
                return self._found(key, holder)
            return "miss"
        if key not in self._asking:
            self._ask(key, remote)
        return "retry"

    def _found(self, key: OffloadKey, tier: Tier) -> Answer:
        self._queued[key] = tier
        self._counts["hits"] += 1
        return "pending"

    def _ask(self, key: OffloadKey, remote: list[Tier]) -> None:
        """Ask the remote tiers for ``key`` off the step (the lookups of one loop turn
        share one call to the store); the answer waits for the next lookup."""

        async def ask() -> Tier | None:
            for tier in remote:
                if await tier.lookup([key]):
                    return tier
            return None

        def answered(task: asyncio.Task[Tier | None]) -> None:
            self._asking.pop(key, None)
            found = None
            if not task.cancelled() and task.exception() is None:
                found = task.result()
            answers = self._answers
            answers[key] = found
            while len(answers) > _MAX_REFUSED:
                del answers[next(iter(answers))]

        task = self._sync.driver.loop.create_task(ask())
        self._asking[key] = task
        task.add_done_callback(answered)

    # -------------------------------------------------------------- stores
    def stored(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` became ready in the pool (a store vLLM completed): offer them."""
        if not keys:
            return
        refused = self._refused
        for key in keys:
            refused.pop(key, None)  # stored again: its bytes are the pool's now
        for tier in self.tiers:
            admitted = tier.offer(keys)
            if admitted:
                self._to_write[tier].update(dict.fromkeys(admitted))

    def tier(self, medium: str | None, *, lowest: bool = False) -> Tier | None:
        """The tier of ``medium`` (any case), or the top (the lowest with ``lowest``)."""
        if medium is None:
            return self.tiers[-1 if lowest else 0]
        for tier in self.tiers:
            if tier.medium.upper() == medium.upper():
                return tier
        return None

    def commit(self, tier: Tier, keys: Sequence[OffloadKey], *, evict: bool) -> None:
        """Write ``keys`` (those in the pool) to ``tier`` at the next step, past its
        admission filter and write limit; with ``evict``, free them from the pool once
        the tier holds them (``kv.durable``, ``kv.demote``)."""
        if keys:
            self._asked.append((tier, list(dict.fromkeys(keys)), evict))

    # ---------------------------------------------------------------- steps
    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._queued or self._asking or self._asked
                    or any(self._to_write.values()))

    def step(self) -> None:
        """Once per engine step: end the transfers that finished, start the promotions
        queued by this step's lookups, and the writes admitted since."""
        try:
            if self._asking and not self._jobs:
                self._sync.driver.poll()  # the remote lookups' turn
            finished = self._sync.get_finished() if self._jobs else []
        except AiokvoError as exc:
            logger.error("aiokvo tiers: collecting transfers failed: %r", exc)
            finished = []
        for result in finished:
            job = self._jobs.pop(result.job_id, None)
            if isinstance(job, _Promotion):
                self._promoted(job, result)
            elif isinstance(job, _Write):
                self._written(job, result)
        if self._queued:
            self._promote()
        if any(self._to_write.values()):
            self._write()
        if self._asked:
            self._write_asked()

    def _submit(self, spec: Any, job: _Promotion | _Write) -> bool:
        job_id = self._next_job
        self._next_job += 1
        try:
            self._sync.submit(job_id, spec)
        except AiokvoError as exc:
            logger.error("aiokvo tiers: a %s transfer was refused: %r", job.tier.medium, exc)
            return False
        self._jobs[job_id] = job
        return True

    # ------------------------------------------------------------ promotion
    def _promote(self) -> None:
        by_tier: dict[Tier, list[OffloadKey]] = {}
        for key, tier in self._queued.items():
            by_tier.setdefault(tier, []).append(key)
        self._queued.clear()
        core = self._core
        for tier, keys in by_tier.items():
            out = core.prepare_store(keys, ReqContext())
            if out is None:  # no room now (pins, stores in flight)
                self._counts["promotions_no_room"] += 1
                self._refuse(keys)
                continue
            reserved = list(out.keys_to_store)
            if not reserved:  # stored meanwhile
                continue
            load = tier.prepare_load(reserved)
            if load is None:  # the breaker, or the tier lost a key
                core.complete_store(reserved, success=False)
                self._refuse(reserved)
                continue
            if not self._submit((load.spec, out.store_spec), _Promotion(tier, reserved, load)):
                tier.complete_load(load, TransferResult(-1, False))
                core.complete_store(reserved, success=False)
                self._refuse(reserved)
                continue
            self._counts["promotions"] += 1

    def _promoted(self, job: _Promotion, result: TransferResult) -> None:
        good: list[OffloadKey] = []
        try:
            good = job.tier.complete_load(job.load, result)
        except Exception as exc:
            logger.error("aiokvo tiers: %s complete_load failed: %r", job.tier.medium, exc)
        keep = set(good)
        ok = [k for k in job.reserved if k in keep]
        bad = [k for k in job.reserved if k not in keep]
        self._counts["promoted_blocks"] += len(ok)
        self._counts["promotion_failures"] += len(bad)
        try:
            if bad:
                self._core.complete_store(bad, success=False)
                self._refuse(bad)
            if ok:
                self._core.complete_store(ok, success=True)
        except AiokvoError as exc:  # reset_cache dropped them meanwhile
            logger.debug("aiokvo tiers: a promotion ended after its keys were dropped: %r", exc)

    def _refuse(self, keys: Sequence[OffloadKey]) -> None:
        refused = self._refused
        refused.update(dict.fromkeys(keys))
        while len(refused) > _MAX_REFUSED:
            del refused[next(iter(refused))]

    # -------------------------------------------------------------- writes
    def _write(self) -> None:
        core = self._core
        for tier, queued in self._to_write.items():
            if not queued:
                continue
            limit = getattr(tier, "max_write_blocks", 0) or core.num_blocks // 2
            room = max(limit - self._pinned_by_writes[tier], 0)
            keys: list[OffloadKey] = []
            for key in queued:
                status = core.block_status(key)
                if status is not None and status.is_ready:
                    keys.append(key)
            skipped = len(queued) - len(keys)
            queued.clear()
            if len(keys) > room and self._pinned_by_writes[tier]:
                skipped += len(keys) - room
                keys = keys[:room]
            self._counts["writes_skipped"] += skipped
            if not keys:
                continue
            pinned = self._start_write(tier, keys)
            self._pinned_by_writes[tier] += len(pinned)
            self._writing[tier].update(pinned)

    def _write_asked(self) -> None:
        asked, self._asked = self._asked, []
        core = self._core
        for tier, keys, evict in asked:
            held = set(tier.committed(keys))
            if evict and held:
                self._evict([k for k in keys if k in held])
            ready: list[OffloadKey] = []
            storing: list[OffloadKey] = []  # its store still in flight: at a later step
            writing = self._writing[tier]
            for key in keys:
                status = core.block_status(key)
                if key in held or status is None:
                    continue
                # A store, or a write to this tier, still in flight: at a later step.
                (ready if status.is_ready and key not in writing else storing).append(key)
            if storing:
                self._asked.append((tier, storing, evict))
            if ready:
                self._writing[tier].update(self._start_write(tier, ready, asked=True, evict=evict))

    def _start_write(
        self, tier: Tier, keys: list[OffloadKey], *, asked: bool = False, evict: bool = False
    ) -> list[OffloadKey]:
        """Pin the pool blocks of the ``keys`` the tier takes and submit their write; the
        keys pinned (none when the tier took none, or the submit failed and was undone)."""
        store = tier.prepare_store(keys)
        if store is None:
            return []
        pinned = list(store.keys)
        src = self._core.prepare_load(pinned, ReqContext())
        job = _Write(tier, store, pinned, asked=asked, evict=evict)
        if not self._submit((src, store.spec), job):
            self._core.complete_load(pinned)
            tier.complete_store(store, TransferResult(-1, False))
            return []
        return pinned

    def _evict(self, keys: Sequence[OffloadKey]) -> None:
        self._counts["demoted_blocks"] += len(self._core.remove(keys))

    def _written(self, job: _Write, result: TransferResult) -> None:
        if not job.asked:
            self._pinned_by_writes[job.tier] -= len(job.pinned)
        self._writing[job.tier].difference_update(job.pinned)
        try:
            self._core.complete_load(job.pinned)
        except AiokvoError as exc:
            logger.debug("aiokvo tiers: a write ended after its keys were dropped: %r", exc)
        try:
            job.tier.complete_store(job.store, result)
        except Exception as exc:
            logger.error("aiokvo tiers: %s complete_store failed: %r", job.tier.medium, exc)
            return
        if job.evict:
            written = job.store.written
            self._evict(job.pinned if written is None and result.success else written or [])

    # ------------------------------------------------------------------ rest
    def reset(self) -> None:
        """vLLM reset the prefix cache: forget what was queued (transfers in flight
        end as usual; their keys are the pool's to drop)."""
        self._queued.clear()
        self._refused.clear()
        self._answers.clear()
        self._asked.clear()
        for queued in self._to_write.values():
            queued.clear()

    def statistics(self) -> SchedulerTierStatistics:
        return SchedulerTierStatistics(**self._counts, in_flight=len(self._jobs))

    def tier_statistics(self) -> list[TierStatistics]:
        return [tier.statistics() for tier in self.tiers]

    def close(self) -> None:
        """Wait for the transfers in flight (each bounded by its tier's deadline), then
        close the tiers, their handlers, the loop and the pool's mapping."""
        close, self._close = self._close, None
        if close is None:
            return
        try:
            asking = list(self._asking.values())
            for task in asking:
                task.cancel()
            if asking:
                self._sync.driver.poll()  # let the cancelled lookups end
            if self._jobs:
                self._sync.wait(list(self._jobs))
                self.step()
        except Exception as exc:
            logger.error("aiokvo tiers: transfers in flight at shutdown: %r", exc)
        finally:
            close()


def open_scheduler_tiers(
    configs: Sequence[TierConfig],
    config: OffloadConfig,
    core: CPUOffloadingManager,
    *,
    instance_id: str,
    dtype: str | None,
) -> SchedulerTiers:
    """Map the engine's pool (the shared region named ``instance_id``), build and
    open the tiers ``configs`` describe over it, and return their driver.

    The pool is seen as one canonical tensor whose row is a block's bytes on
    every rank (``world_size x kv_bytes_per_block x block_size_factor``), used
    by every KV group: the manager does not know how the workers split a row
    into layers, and need not (a tier moves whole rows). A tier's layout
    fingerprint is therefore the model id, ``dtype``, the row's bytes, the
    groups' tokens per block and the world size. ``dtype`` is vLLM's KV dtype
    (None: each tier must name its own, or it refuses to bind).
    """
    from aiokvo.handlers.sync import SyncOffloadingWorker
    from aiokvo.handlers.worker import OffloadingWorker
    from aiokvo.layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    from aiokvo.memory.shared_region import SharedOffloadRegion
    from aiokvo.runtime.pump import PumpedLoop
    from aiokvo.tiers.base import TierBinding
    from aiokvo.tiers.registry import build_tier

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ConfigError(
            "aiokvo_tiers: the thread building vLLM's scheduler runs an event loop, and the "
            "tiers' manager pumps a loop of its own there; run the engine core in its own "
            "process (vLLM's default, VLLM_ENABLE_V1_MULTIPROCESSING=1)"
        )
    region = SharedOffloadRegion(
        instance_id,
        num_blocks=config.num_cpu_blocks,
        num_workers=config.world_size,
        page_bytes_per_rank=config.kv_bytes_per_block * config.block_size_factor,
        rank=None,
    )
    driver = PumpedLoop()
    tiers: list[Tier] = []
    worker: OffloadingWorker | None = None

    def close() -> None:
        try:
            try:
                if worker is not None:
                    driver.run(worker.aclose())
            finally:
                for tier in tiers:
                    try:
                        driver.run(tier.aclose())
                    except Exception as exc:
                        logger.error("aiokvo tiers: closing the %s tier: %r", tier.medium, exc)
        finally:
            driver.close()
            region.close()

    try:
        rows = region.rows()
        page = rows.shape[1] // config.block_size_factor
        groups = [[CanonicalKVCacheRef(0, page)] for _ in config.gpu_block_sizes]
        kv = CanonicalKVCaches([CanonicalKVCacheTensor(rows, page)], groups, dtype=dtype)
        binding = TierBinding(kv, (rows,), config, core.sink, dtype)
        worker = OffloadingWorker()
        for tier_config in configs:
            tier: Tier = build_tier(tier_config)
            routes = tier.bind(binding)
            tiers.append(tier)
            for route in routes:
                worker.register_handler(*route)
        for tier in tiers:
            driver.run(tier.open())
        sync = SyncOffloadingWorker(worker, driver, retries=0)
    except BaseException:
        close()
        raise
    return SchedulerTiers(tiers, core, sync, close)
