"""``TierDriver``: the Offloader's tiers, promotion into the CPU pool and write-through.

Two workflows, each a transfer whose done-callback completes it exactly once
(as the Offloader's own copies are):

* **promotion** (a load whose CPU prefix ends early): the tier says how many
  of the next keys it has; CPU blocks are reserved for them
  (``prepare_store`` on the CPU manager, which protects every key it is
  named), the tier pins its copies, and one ``(tier, CPU)`` transfer reads
  them in. The keys are "being written" in the CPU pool meanwhile, so other
  loads wait for the promotion instead of racing it. When it ends, only the
  keys whose bytes the tier vouches for (checksums) are completed as stored;
  the rest are released. The load then pins the longer prefix and copies it
  to the GPU in one transfer;
* **write-through** (a store, or a store naming keys the pool holds): each
  tier's admission filter counts the offer; admitted keys that are ready in
  the CPU pool are pinned there (so a CPU eviction cannot take them while
  they are copied) and written with one ``(CPU, tier)`` transfer. Once a
  tier's writes in flight pin ``max_write_blocks`` CPU blocks (default half
  the pool), further keys are not written (counted): a slow tier never
  starves the pool, it only writes less. A store's keys always go when none
  are in flight.

The reuse filter (``store_threshold``) does not apply to promotions: a tier
hit is a reuse. All of this runs on the loop's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Protocol

from aiokvo.errors import (
    BlockNotReadyError,
    ConfigError,
    TransferSpecError,
    UnknownKeyError,
)
from aiokvo.handlers.task import TransferTask
from aiokvo.handlers.worker import OffloadingWorker
from aiokvo.keys import OffloadKey
from aiokvo.manager.base import OffloadingManager
from aiokvo.offloader.blocks import GpuBlocks
from aiokvo.offloader.inflight import InFlight
from aiokvo.specs import PrepareStoreOutput, ReqContext, TransferResult
from aiokvo.tiers.base import Tier, TierLoad, TierStatistics, TierStore

__all__ = ["Landed", "Promotion", "TierDriver", "positions"]


class TierOwner(Protocol):
    """What the driver needs from its :class:`~aiokvo.Offloader`."""

    _manager: OffloadingManager
    _worker: OffloadingWorker
    _copies: dict[int, InFlight]
    _writing: dict[OffloadKey, InFlight]

    def _job(self) -> int: ...

    def _track(self, task: TransferTask) -> InFlight: ...

    def _report(self, call: str, error: Exception) -> None: ...

    def _evicted(self, keys: Sequence[OffloadKey]) -> None: ...


Landed = Callable[["Promotion"], None]
"""Told of a promotion when it completes, in its done-callback: its ``good`` keys are
ready in the pool from that moment, before any coroutine runs again."""


class Promotion:
    """One promotion in flight: ``reserved`` keys read from ``tier`` into the CPU pool."""

    __slots__ = ("copy", "good", "landed", "reserved", "tier")

    def __init__(
        self, tier: Tier, reserved: list[OffloadKey], copy: InFlight, landed: Landed | None
    ) -> None:
        self.tier = tier
        self.reserved = reserved
        self.copy = copy
        self.landed = landed
        self.good: list[OffloadKey] = []


def positions(
    keys: list[OffloadKey], blocks: GpuBlocks | None, lo: int, hi: int
) -> list[OffloadKey]:
    """The keys at prefix positions ``[lo, hi)`` of every group, group by group."""
    if blocks is None or blocks.num_groups == 1:
        return keys[lo:hi]
    found: list[OffloadKey] = []
    for start, stop in blocks.group_key_ranges():
        found.extend(keys[start + lo : min(start + hi, stop)])
    return found


def _failed(error: BaseException) -> TransferResult:
    return TransferResult(job_id=-1, success=False, error=error)


class TierDriver:
    """The tiers of one Offloader, top first; see the module docstring."""

    def __init__(
        self,
        owner: TierOwner,
        tiers: Sequence[Tier],
        *,
        store_manager: OffloadingManager,
        pool_blocks: int,
    ) -> None:
        media = [t.medium for t in tiers]
        if len(set(media)) != len(media):
            raise ConfigError(f"each tier needs its own medium, got {media}")
        self._owner = owner
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self._store_manager = store_manager  # the CPU manager promotions reserve in
        self._ready: Callable[[OffloadKey], bool] | None = _ready_probe(store_manager)
        self._limit = {
            t: getattr(t, "max_write_blocks", 0) or max(1, pool_blocks // 2) for t in tiers
        }
        self._pinned_by_writes = dict.fromkeys(self.tiers, 0)
        # key -> its write in flight to each tier (durable and demote wait for it)
        self._writes: dict[Tier, dict[OffloadKey, InFlight]] = {t: {} for t in self.tiers}
        self._pool_blocks = pool_blocks
        self._opening: asyncio.Future[None] | None = None
        self.opened = False
        self._ctx = ReqContext()
        # What only the Offloader knows (OffloaderStatistics); the tiers count their
        # reads (the promotions) and writes themselves.
        self.hits = dict.fromkeys(media, 0)
        self.promotion_timeouts = self.promotions_no_room = self.writes_skipped = 0

    # ------------------------------------------------------------- opening
    async def open(self) -> None:
        """Open every tier once (concurrent callers share the one opening)."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)

    async def _open(self) -> None:
        for tier in self.tiers:
            await tier.open()
        self.opened = True

    async def connected(self) -> None:
        """Wait for each tier that connects to have made its first attempt."""
        await asyncio.gather(*(tier.first_connection() for tier in self.tiers))

    async def aclose(self) -> None:
        """Close every tier (after the worker closed their handlers)."""
        errors: list[BaseException] = []
        for tier in self.tiers:
            try:
                await tier.aclose()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    # ---------------------------------------------------------- promotion
    async def promote(
        self,
        keys: list[OffloadKey],
        blocks: GpuBlocks | None,
        lo: int,
        hi: int,
        ctx: ReqContext,
        *,
        held: int = 0,
        timeout: float | None = None,
        on_landed: Landed | None = None,
    ) -> list[Promotion] | None:
        """Read the tiers' blocks at positions ``[lo, hi)`` into the CPU pool, and wait.

        Each tier continues where the one above stopped; no more keys are
        promoted than the pool can hold next to the ``held`` keys the load
        pinned (a prefix loads whole or not at all); a tier's keys the pool has
        no room for (counted in ``promotions_no_room``), or that the tier will
        not read, end the prefix, with nothing left reserved. ``blocks`` None:
        ``keys`` are one group. Waits up to ``timeout`` (default: the slowest
        tier's ``io_timeout``), then returns None if a promotion is still
        running (it completes itself later), else the promotions started.
        ``on_landed`` is told of each promotion as it completes, whatever became
        of this call (a prefetch follows its blocks from there).
        """
        started: list[Promotion] = []
        room = self._pool_blocks - held
        cursor = lo
        for tier in self.tiers:
            if cursor >= hi:
                break
            found: int | None = None
            for group in _group_slices(keys, blocks, cursor, hi):
                n = await tier.lookup(group)
                found = n if found is None else min(found, n)
                if not found:
                    break
            while found and len(positions(keys, blocks, cursor, cursor + found)) > room:
                found -= 1
            if not found:
                continue
            wanted = positions(keys, blocks, cursor, cursor + found)
            room -= len(wanted)
            out = self._store_manager.prepare_store(wanted, ctx)
            if out is None:  # no room (others' pins, stores in flight): the prefix ends here
                self.promotions_no_room += 1
                break
            if out.evicted_keys:
                self._owner._evicted(out.evicted_keys)
            if out.keys_to_store:  # else another load or store brought them in meanwhile
                promotion = self._start(tier, out, on_landed)
                if promotion is None:
                    break  # the tier did not read them: later tiers' keys would follow a gap
                started.append(promotion)
            cursor += found
        if started:
            if timeout is None:
                timeout = max(p.tier.io_timeout for p in started)
            _, pending = await asyncio.wait([p.copy.ended() for p in started], timeout=timeout)
            self.promotion_timeouts += len(pending)
            if pending:
                return None  # the load goes on with what it holds
        return started

    def _start(
        self, tier: Tier, out: PrepareStoreOutput, on_landed: Landed | None
    ) -> Promotion | None:
        """Read ``out``'s reserved keys from ``tier``; None (reservation released) if not."""
        owner = self._owner
        manager = self._store_manager
        reserved = out.keys_to_store
        load = tier.prepare_load(reserved)
        if load is None:
            manager.complete_store(reserved, success=False)
            return None
        try:
            task = owner._worker.transfer_async(owner._job(), (load.spec, out.store_spec))
        except BaseException as exc:
            tier.complete_load(load, _failed(exc))
            manager.complete_store(reserved, success=False)
            if isinstance(exc, TransferSpecError) or not isinstance(exc, Exception):
                raise
            owner._report(f"{tier.medium} promotion", exc)
            return None
        copy = owner._track(task)
        copy.patience = tier.io_timeout  # a load waiting for it gives up at the deadline
        owner._writing.update(dict.fromkeys(reserved, copy))
        promotion = Promotion(tier, reserved, copy, on_landed)
        task.add_done_callback(partial(self._promotion_done, promotion, load))
        return promotion

    def _promotion_done(self, promotion: Promotion, load: TierLoad, task: TransferTask) -> None:
        owner = self._owner
        result = task.result()
        reserved = promotion.reserved
        good: list[OffloadKey] = []
        try:
            good = promotion.tier.complete_load(load, result)
        except Exception as exc:
            owner._report(f"{promotion.tier.medium} complete_load", exc)
        keep = set(good)
        ok = [k for k in reserved if k in keep]
        bad = [k for k in reserved if k not in keep]
        try:
            if bad:
                self._store_manager.complete_store(bad, success=False)
            if ok:
                self._store_manager.complete_store(ok, success=True)
        except Exception as exc:
            owner._report("complete_store", exc)
        finally:
            # Nothing below can raise: the waiters are always woken.
            promotion.good = ok
            writing = owner._writing
            for key in reserved:
                writing.pop(key, None)
            owner._copies.pop(result.job_id, None)
            if promotion.landed is not None:
                try:  # now, before a load can pin the keys: they are ready from here
                    promotion.landed(promotion)
                except Exception as exc:
                    owner._report("promotion landed", exc)
            promotion.copy.finish(replace(result, success=not bad))

    def count_hits(self, pinned: list[OffloadKey], promotions: list[Promotion]) -> int:
        """Credit each promoted key in ``pinned`` to its tier; the CPU pool's share."""
        from_tiers = 0
        if promotions:
            loaded = set(pinned)
            for p in promotions:
                n = sum(1 for k in p.good if k in loaded)
                self.hits[p.tier.medium] += n
                from_tiers += n
        return len(pinned) - from_tiers

    # -------------------------------------------------------- write-through
    def offer(self, keys: Sequence[OffloadKey]) -> list[list[OffloadKey]]:
        """Offer ``keys`` to every tier; per tier, the keys to write."""
        return [tier.offer(keys) for tier in self.tiers]

    def write_ready(self, admitted: list[list[OffloadKey]], skip: set[OffloadKey]) -> None:
        """Write the admitted keys that are ready in the CPU pool now (not in ``skip``)."""
        ready = self._ready
        if ready is None:
            return
        writing = self._owner._writing
        for tier, keys in zip(self.tiers, admitted, strict=True):
            now = [k for k in keys if k not in skip and k not in writing and ready(k)]
            if now:
                self.write(tier, now)

    def write(self, tier: Tier, keys: list[OffloadKey], *, asked: bool = False) -> InFlight | None:
        """Pin ``keys`` (ready in the CPU pool) and write them to ``tier``; the copy.

        ``asked``: a caller asked for these keys (``demote``, ``durable``), so the
        write-through limit does not cut them (they are freed or waited for).
        """
        pinned = self._pinned_by_writes[tier]
        room = self._limit[tier] - pinned
        if pinned and len(keys) > room and not asked:  # with none in flight, a whole store goes
            self.writes_skipped += len(keys) - max(room, 0)
            keys = keys[: max(room, 0)]
            if not keys:
                return None
        owner = self._owner
        store = tier.prepare_store(keys)
        if store is None:
            return None
        manager = owner._manager
        try:
            src = manager.prepare_load(store.keys, self._ctx)
        except (UnknownKeyError, BlockNotReadyError) as exc:  # evicted or rewritten meanwhile
            self._end_store(tier, store, _failed(exc))
            return None
        try:
            task = owner._worker.transfer_async(owner._job(), (src, store.spec))
        except BaseException as exc:
            manager.complete_load(store.keys)
            self._end_store(tier, store, _failed(exc))
            if not isinstance(exc, Exception):
                raise
            owner._report(f"{tier.medium} write", exc)
            return None
        copy = owner._track(task)
        copy.patience = tier.io_timeout  # a tier transfer: bounded by its deadline
        self._pinned_by_writes[tier] += len(store.keys)
        self._writes[tier].update(dict.fromkeys(store.keys, copy))
        task.add_done_callback(partial(self._write_done, tier, store, copy))
        return copy

    def writing(self, tier: Tier, key: OffloadKey) -> InFlight | None:
        """``key``'s write in flight to ``tier``, if any."""
        return self._writes[tier].get(key)

    def _write_done(self, tier: Tier, store: TierStore, copy: InFlight, task: TransferTask) -> None:
        owner = self._owner
        result = task.result()
        try:
            self._end_store(tier, store, result)
        except Exception as exc:
            owner._report(f"{tier.medium} complete_store", exc)
        try:
            owner._manager.complete_load(store.keys)
        except Exception as exc:
            owner._report("complete_load", exc)
        finally:
            owner._copies.pop(result.job_id, None)
            self._pinned_by_writes[tier] -= len(store.keys)
            writes = self._writes[tier]
            for key in store.keys:
                if writes.get(key) is copy:
                    del writes[key]
            copy.finish(result)

    def _end_store(self, tier: Tier, store: TierStore, result: TransferResult) -> None:
        """Hand ``store`` back to ``tier`` (which counts its blocks written or not)."""
        tier.complete_store(store, result)

    # ----------------------------------------------------------- reporting
    def statistics(self) -> tuple[TierStatistics, ...]:
        return tuple(tier.statistics() for tier in self.tiers)

    @property
    def pinned_by_writes(self) -> int:
        return sum(self._pinned_by_writes.values())

    @property
    def write_limit(self) -> int:
        """CPU blocks write-through may pin at once: every tier's ``max_write_blocks``
        (an upper bound: tiers writing the same blocks share pins), at most the pool."""
        return min(self._pool_blocks, sum(self._limit.values()))


def _group_slices(
    keys: list[OffloadKey], blocks: GpuBlocks | None, lo: int, hi: int
) -> list[list[OffloadKey]]:
    """Each group's keys at positions ``[lo, hi)`` (groups without any left out)."""
    if blocks is None or blocks.num_groups == 1:
        return [keys[lo:hi]]
    slices = []
    for start, stop in blocks.group_key_ranges():
        part = keys[start + lo : min(start + hi, stop)]
        if part:
            slices.append(part)
    return slices


def _ready_probe(manager: OffloadingManager) -> Callable[[OffloadKey], bool] | None:
    """A side-effect-free "is this key ready in the pool?" (lookups count towards the
    reuse filter, so they will not do), where the manager has one."""
    status = getattr(manager, "block_status", None)
    if status is None:
        return None

    def ready(key: OffloadKey) -> bool:
        found = status(key)
        return found is not None and bool(found.is_ready)

    return ready
