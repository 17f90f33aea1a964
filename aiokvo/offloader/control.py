"""``CacheControl``: the hints of agents and orchestrators, each one awaitable call.

A scheduler knows what the cache cannot: a conversation paused for a tool
call, a turn that will come back, a prefix the next request will need. Each
hint is a call with a deadline whose cancellation cancels only the wait:

* :meth:`~CacheControl.prefetch` promotes the longest prefix found below
  the CPU pool into it, with no GPU blocks; per call, so each request's
  reads have their own deadline and (the tiers' ``read_slots``) their own
  lane. A load of the same keys waits for the promotion instead of reading
  twice (the keys are "being written" in the pool meanwhile);
* :meth:`~CacheControl.demote` makes sure keys are committed in the tier
  below, then frees their CPU blocks;
* :meth:`~CacheControl.retain` is soft retention
  (:class:`~aiokvo.manager.retention.Retention`): evicted last, within a
  budget, ending after a ttl; never a hard pin;
* :meth:`~CacheControl.durable` returns once keys are committed in a tier
  (default the lowest), so another replica can read them.

Every copy started here completes itself in its done-callback (the
Offloader's rule), so a cancelled or late call leaves no pin, reservation or
half-written block behind: a promotion that ends after its prefetch gave up
still lands in the pool, counted ``late``. Blocks a prefetch brought in are
followed until a load uses them (``used``) or the pool drops them first
(``wasted``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self

from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey, check_keys, key_sequence
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.retention import Retention, RetentionStatistics
from aiokvo.offloader.inflight import InFlight
from aiokvo.offloader.tiered import Promotion, TierDriver
from aiokvo.specs import ReqContext
from aiokvo.tiers.base import Tier

__all__ = ["CacheControl", "ControlStatistics", "Retained"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlStatistics:
    """What the cache-control calls did, since the Offloader was made."""

    prefetches: int = 0
    """``prefetch`` calls."""
    prefetches_completed: int = 0
    """Prefetches whose promotions all ended before their deadline."""
    prefetches_late: int = 0
    """Prefetches whose deadline passed with a promotion still running (it lands later)."""
    prefetched_blocks: int = 0
    """Blocks prefetches promoted into the pool (their checksums good)."""
    prefetch_used_blocks: int = 0
    """Prefetched blocks a load or lease used."""
    prefetch_wasted_blocks: int = 0
    """Prefetched blocks the pool dropped before any load used them."""
    demotions: int = 0
    """``demote`` calls."""
    demoted_blocks: int = 0
    """Blocks committed below and freed from the pool by ``demote``."""
    durable_waits: int = 0
    """``durable`` calls."""
    durable_timeouts: int = 0
    """``durable`` calls that returned at their timeout with keys not yet committed."""
    retention: RetentionStatistics | None = None
    """Retained blocks, the budget and the retentions (None: retention is off)."""


class ControlOwner(Protocol):
    """What the control calls need from their :class:`~aiokvo.Offloader`."""

    _manager: OffloadingManager
    _writing: dict[OffloadKey, InFlight]

    def _check_open(self, what: str) -> None: ...

    async def ready(self, keys: Iterable[OffloadKey]) -> None: ...


class Retained:
    """A soft retention from :meth:`CacheControl.retain`: release it, or use it as a
    (sync or async) context manager. Ends by itself after its ttl."""

    __slots__ = ("_id", "_retention", "keys", "priority", "ttl")

    def __init__(
        self,
        retention: Retention,
        handle: int,
        keys: tuple[OffloadKey, ...],
        priority: int,
        ttl: float,
    ) -> None:
        self._retention = retention
        self._id = handle
        self.keys = keys
        self.priority = priority
        self.ttl = ttl

    @property
    def alive(self) -> bool:
        """Still retaining: not released, not past its ttl, not displaced by a
        higher (or newer) retention that needed the budget."""
        return self._retention.alive(self._id)

    def release(self) -> bool:
        """End the retention now (False: it had ended already). Idempotent."""
        return self._retention.release(self._id)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "ended"
        return f"<Retained {len(self.keys)} keys priority={self.priority} {state}>"


def check_seconds(name: str, value: float | None) -> float | None:
    """A deadline or timeout: None, or a finite number of seconds >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and value >= 0
    ):  # fmt: skip
        raise ConfigError(f"{name} must be None or a finite number of seconds >= 0, got {value!r}")
    return float(value)


class CacheControl:
    """The Offloader's prefetch, demote, retain and durable; see the module."""

    def __init__(
        self,
        owner: ControlOwner,
        driver: TierDriver | None,
        pool: OffloadingManager,
        retention: Retention | None,
        pool_blocks: int,
    ) -> None:
        self._owner = owner
        self._driver = driver
        self._pool = pool  # the CPU manager itself (its status reads count nothing)
        self.retention = retention
        self._pool_blocks = pool_blocks
        self._ctx = ReqContext()
        # Keys a prefetch brought in that no load has used yet, oldest first.
        self._prefetched: dict[OffloadKey, None] = {}
        self.prefetches = self.prefetches_completed = self.prefetches_late = 0
        self.prefetched_blocks = self.used_blocks = self.wasted_blocks = 0
        self.demotions = self.demoted_blocks = 0
        self.durable_waits = self.durable_timeouts = 0

    # -------------------------------------------------------------- prefetch
    async def prefetch(self, keys: Iterable[OffloadKey], *, deadline: float | None) -> int:
        """See :meth:`Offloader.prefetch <aiokvo.Offloader.prefetch>`."""
        owner = self._owner
        owner._check_open("prefetch")
        keys = _checked(keys, "Offloader.prefetch")
        timeout = check_seconds("deadline", deadline)
        self.prefetches += 1
        driver = self._driver
        if driver is None or not keys:
            self.prefetches_completed += 1
            return self.ready_prefix(keys)
        loop = asyncio.get_running_loop()
        until = None if timeout is None else loop.time() + timeout
        late = False
        try:
            async with asyncio.timeout_at(until):
                if not driver.opened:
                    await driver.open()
                    owner._check_open("prefetch")
                n = await self._settled_prefix(keys)
                if n < len(keys):
                    late = await self._promote(driver, keys, n, until)
        except TimeoutError:
            late = True
        if late:
            self.prefetches_late += 1
        else:
            self.prefetches_completed += 1
        return self.ready_prefix(keys)

    async def _settled_prefix(self, keys: list[OffloadKey]) -> int:
        """The ready prefix once no store or promotion of it is in flight."""
        status, writing = self._pool.block_status, self._owner._writing
        while True:
            n = self.ready_prefix(keys)
            if n == len(keys) or status(keys[n]) is None:
                return n
            copy = writing.get(keys[n])
            if copy is None:  # written by a caller that did not go through us
                return n
            await asyncio.wait((copy.ended(),))

    async def _promote(
        self,
        driver: TierDriver,
        keys: list[OffloadKey],
        n: int,
        until: float | None,
    ) -> bool:
        """Promote ``keys[n:]`` with ``keys[:n]`` pinned meanwhile; True if late."""
        manager = self._owner._manager
        held = keys[:n]
        if held:
            manager.prepare_load(held, self._ctx)  # promotions must not evict them
        try:
            timeout = None
            if until is not None:
                timeout = max(0.0, until - asyncio.get_running_loop().time())
            done = await driver.promote(
                keys, None, n, len(keys), self._ctx, held=n, timeout=timeout,
                on_landed=self._landed,
            )  # fmt: skip
        finally:
            if held:
                manager.complete_load(held)
        return done is None

    def ready_prefix(self, keys: Sequence[OffloadKey]) -> int:
        """Leading ``keys`` ready in the CPU pool now (counting nothing)."""
        status = self._pool.block_status
        for i, key in enumerate(keys):
            found = status(key)
            if found is None or not found.is_ready:
                return i
        return len(keys)

    def _landed(self, promotion: Promotion) -> None:
        """In the promotion's done-callback: its keys are ready now, and no load has
        pinned them yet (a load that pins them from here on used them)."""
        good = promotion.good
        if not good:
            return
        self.prefetched_blocks += len(good)
        self._prefetched.update(dict.fromkeys(good))
        if len(self._prefetched) > self._pool_blocks:
            self._sweep()

    def used(self, keys: Sequence[OffloadKey]) -> None:
        """A load or lease pinned ``keys``: prefetched ones among them were used."""
        self.used_blocks += self._forget(keys)

    def evicted(self, keys: Sequence[OffloadKey]) -> None:
        """The pool evicted ``keys``: prefetched ones among them were wasted."""
        self.wasted_blocks += self._forget(keys)

    def _forget(self, keys: Sequence[OffloadKey]) -> int:
        """Drop ``keys`` from the prefetched set; how many of them were in it."""
        prefetched = self._prefetched
        if not prefetched:
            return 0
        before = len(prefetched)
        for key in keys:
            prefetched.pop(key, None)
        return before - len(prefetched)

    def _sweep(self) -> None:
        """Count as wasted the prefetched keys the pool no longer has (dropped by a
        path that does not report evictions here, e.g. the manager driven by hand)."""
        status = self._pool.block_status
        gone = [k for k in self._prefetched if status(k) is None]
        self.evicted(gone)

    # ---------------------------------------------------------------- demote
    async def demote(self, keys: Iterable[OffloadKey]) -> int:
        """See :meth:`Offloader.demote <aiokvo.Offloader.demote>`."""
        owner = self._owner
        owner._check_open("demote")
        keys = _checked(keys, "Offloader.demote")
        driver = self._tiers("demote")
        self.demotions += 1
        if not driver.opened:
            await driver.open()
        await owner.ready(keys)  # stores of these keys in flight end first
        tier = driver.tiers[0]
        in_pool = [k for k in dict.fromkeys(keys) if self._is_ready(k)]
        committed = set(await self._commit(driver, tier, in_pool))
        freed = self._remove([k for k in in_pool if k in committed])
        self.demoted_blocks += len(freed)
        return len(freed)

    def _remove(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        remove = getattr(self._pool, "remove", None)
        if remove is None or not keys:
            return []
        freed: list[OffloadKey] = remove(keys)
        prefetched = self._prefetched
        for key in freed:
            prefetched.pop(key, None)  # freed on purpose: neither used nor wasted
        return freed

    # --------------------------------------------------------------- durable
    async def durable(
        self, keys: Iterable[OffloadKey], tier: Tier | str | None, timeout: float | None
    ) -> int:
        """See :meth:`Offloader.durable <aiokvo.Offloader.durable>`."""
        owner = self._owner
        owner._check_open("durable")
        keys = _checked(keys, "Offloader.durable")
        seconds = check_seconds("timeout", timeout)
        driver = self._tiers("durable")
        target = _which_tier(driver, tier)
        self.durable_waits += 1
        try:
            async with asyncio.timeout(seconds):
                if not driver.opened:
                    await driver.open()
                await owner.ready(keys)
                await self._commit(driver, target, keys)
        except TimeoutError:
            self.durable_timeouts += 1
        return len(target.committed(keys))

    async def _commit(
        self, driver: TierDriver, tier: Tier, keys: Sequence[OffloadKey]
    ) -> list[OffloadKey]:
        """Write to ``tier`` the ``keys`` it lacks (from the CPU pool), wait for those
        writes and any in flight; the keys it holds committed then."""
        held = set(tier.committed(keys))
        missing = [k for k in dict.fromkeys(keys) if k not in held]
        copies = {c for k in missing if (c := driver.writing(tier, k)) is not None}
        fresh = [k for k in missing if driver.writing(tier, k) is None and self._is_ready(k)]
        if fresh:
            copy = driver.write(tier, fresh, asked=True)
            if copy is not None:
                copies.add(copy)
        if copies:
            await asyncio.wait([c.ended() for c in copies])
        return tier.committed(keys)

    # ---------------------------------------------------------------- retain
    def retain(self, keys: Iterable[OffloadKey], *, priority: int, ttl: float) -> Retained:
        """See :meth:`Offloader.retain <aiokvo.Offloader.retain>`."""
        self._owner._check_open("retain")
        retention = self.retention
        if retention is None:
            raise ConfigError(
                "retention is off for this Offloader (config.retention_fraction=0, or its "
                "pool's manager cannot evict around retained blocks)"
            )
        keys = _checked(keys, "Offloader.retain")
        handle = retention.retain(keys, priority=priority, ttl=ttl)
        return Retained(retention, handle, tuple(keys), priority, ttl)

    # -------------------------------------------------------------- helpers
    def _is_ready(self, key: OffloadKey) -> bool:
        found = self._pool.block_status(key)
        return found is not None and bool(found.is_ready)

    def _tiers(self, what: str) -> TierDriver:
        if self._driver is None:
            raise ConfigError(f"{what} needs a tier below the CPU pool (Offloader(tiers=[...]))")
        return self._driver

    def statistics(self) -> ControlStatistics:
        if self._prefetched:
            self._sweep()
        retention = self.retention
        return ControlStatistics(
            prefetches=self.prefetches,
            prefetches_completed=self.prefetches_completed,
            prefetches_late=self.prefetches_late,
            prefetched_blocks=self.prefetched_blocks,
            prefetch_used_blocks=self.used_blocks,
            prefetch_wasted_blocks=self.wasted_blocks,
            demotions=self.demotions,
            demoted_blocks=self.demoted_blocks,
            durable_waits=self.durable_waits,
            durable_timeouts=self.durable_timeouts,
            retention=None if retention is None else retention.statistics(),
        )


def _checked(keys: Iterable[OffloadKey], what: str) -> list[OffloadKey]:
    found = list(key_sequence(keys, what))
    check_keys(found, what)
    return found


def _which_tier(driver: TierDriver, tier: Tier | str | None) -> Tier:
    """The tier named by object or medium (None: the lowest)."""
    if tier is None:
        return driver.tiers[-1]
    for candidate in driver.tiers:
        if candidate is tier or candidate.medium == tier:
            return candidate
    media = [t.medium for t in driver.tiers]
    raise ConfigError(f"tier {tier!r} is not one of this Offloader's tiers {media}")
