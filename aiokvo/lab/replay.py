"""Replay a request trace through the real CPU manager, one policy and pool size at a time.

Each request is driven as the Offloader (and vLLM's scheduler) drives the
manager: ``lookup_prefix`` over its keys, ``prepare_load``/``complete_load``
of the prefix found, ``prepare_store`` of all its keys (the pool skips those
it holds), ``touch`` of all of them while the new ones are still being
written, then ``complete_store``. A request hits its longest cached prefix
only; ``hit_rate`` is the references served from the pool over all
references. A store that cannot fit (a request larger than the pool, or
all of it pinned) is counted as refused and the request goes on.

With tiers (``TierModel``), each tier below the pool is replayed as its
index: the same pure :class:`~aiokvo.manager.slots.SlotManager` a disk tier
keeps over its slots, written through (every block the pool newly stores is
offered to each tier) and read on a pool miss (the longest prefix a tier
holds after the pool's is promoted into the pool). No bytes move; blocks
and bytes (``block_bytes`` each) are counted per tier from its decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiokvo._util import check_int
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies.base import CachePolicy
from aiokvo.manager.slots import SlotManager
from aiokvo.specs import ReqContext

__all__ = ["ReplayResult", "TierModel", "TierResult", "capacity_blocks", "replay"]

Progress = Callable[[int, int], None]
"""Called as ``progress(requests_done, requests_total)`` every few thousand requests."""


@dataclass(frozen=True)
class TierModel:
    """A tier below the pool: ``name`` (its medium) and ``capacity_blocks`` slots."""

    name: str
    capacity_blocks: int


@dataclass(frozen=True)
class TierResult:
    """What one tier below the pool served and moved during a replay."""

    name: str
    capacity_blocks: int
    hits: int  # references served from this tier (promoted into the pool)
    blocks_written: int
    blocks_read: int
    blocks_evicted: int


@dataclass(frozen=True)
class ReplayResult:
    """One (policy, pool size) replay: hits, blocks moved and how long it took."""

    policy: str
    capacity_blocks: int
    requests: int
    references: int
    hits: int
    blocks_stored: int
    blocks_evicted: int
    stores_refused: int
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time: steadier on a shared machine
    tiers: tuple[TierResult, ...] = field(default=())

    @property
    def hit_rate(self) -> float:
        """References served from the pool over all references."""
        return self.hits / self.references if self.references else 0.0

    @property
    def references_per_second(self) -> float:
        return self.references / self.seconds if self.seconds > 0 else float("inf")


def capacity_blocks(fraction: float, distinct_blocks: int) -> int:
    """Pool blocks for ``fraction`` of a trace's distinct blocks (at least one)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ConfigError(f"capacity fraction must be a number, got {fraction!r}")
    if not 0 < fraction <= 1:
        raise ConfigError(f"capacity fraction must be in (0, 1], got {fraction!r}")
    return max(1, round(fraction * distinct_blocks))


def replay(
    requests: Sequence[Sequence[OffloadKey]],
    policy: str | type[CachePolicy],
    capacity: int,
    *,
    tiers: Sequence[TierModel] = (),
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay ``requests`` (each a list of keys, prefix first) through a fresh manager."""
    capacity = check_int("capacity", capacity, minimum=1)
    manager = CPUOffloadingManager(capacity, policy)
    below = [
        SlotManager(check_int("tier capacity", tier.capacity_blocks, minimum=1), policy,
                    medium=tier.name)
        for tier in tiers
    ]  # fmt: skip
    if below:
        return _replay_tiered(requests, manager, below, _name(policy), progress)
    ctx = ReqContext()
    lookup, load, loaded = manager.lookup_prefix, manager.prepare_load, manager.complete_load
    store, touch, stored = manager.prepare_store, manager.touch, manager.complete_store
    hits = refused = 0
    step = max(1, len(requests) // 200)
    started, cpu = time.perf_counter(), time.process_time()
    for done, keys in enumerate(requests, 1):
        found = lookup(keys, ctx)
        if found:  # None cannot happen: every store completes before the next request
            prefix = keys[:found]
            load(prefix, ctx)
            loaded(prefix)
            hits += found
        out = store(keys, ctx)
        touch(keys)
        if out is None:
            refused += 1
        else:
            stored(out.reservation)
        if progress is not None and not done % step:
            progress(done, len(requests))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    stats = manager.statistics()
    return ReplayResult(
        policy=_name(policy),
        capacity_blocks=capacity,
        requests=len(requests),
        references=sum(map(len, requests)),
        hits=hits,
        blocks_stored=stats.blocks_stored,
        blocks_evicted=stats.blocks_evicted,
        stores_refused=refused,
        seconds=seconds,
        cpu_seconds=cpu,
    )


def _replay_tiered(
    requests: Sequence[Sequence[OffloadKey]],
    manager: CPUOffloadingManager,
    below: list[SlotManager],
    name: str,
    progress: Progress | None,
) -> ReplayResult:
    ctx = ReqContext()
    hits = refused = 0
    tier_hits = [0] * len(below)  # every hit below is a read promoting it
    step = max(1, len(requests) // 200)
    started, cpu = time.perf_counter(), time.process_time()
    for done, keys in enumerate(requests, 1):
        found = manager.lookup_prefix(keys, ctx) or 0
        if found:
            manager.prepare_load(keys[:found], ctx)
            manager.complete_load(keys[:found])
            hits += found
        reach = found
        for index, tier in enumerate(below):  # the next tier continues where this one stopped
            more = tier.lookup_prefix(keys[reach:], ctx) or 0
            if more:
                promoted = keys[reach : reach + more]
                tier.prepare_load(promoted, ctx)
                tier.complete_load(promoted)
                tier.touch(promoted)
                tier_hits[index] += more
                reach += more
        out = manager.prepare_store(keys, ctx)
        manager.touch(keys)
        if out is None:
            refused += 1
            continue
        manager.complete_store(out.reservation)
        if out.keys_to_store:
            for tier in below:  # write-through of what the pool newly holds
                written = tier.prepare_store(out.keys_to_store, ctx)
                if written is not None:
                    tier.complete_store(written.reservation)
        if progress is not None and not done % step:
            progress(done, len(requests))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    stats = manager.statistics()
    return ReplayResult(
        policy=name,
        capacity_blocks=manager.num_blocks,
        requests=len(requests),
        references=sum(map(len, requests)),
        hits=hits,
        blocks_stored=stats.blocks_stored,
        blocks_evicted=stats.blocks_evicted,
        stores_refused=refused,
        seconds=seconds,
        cpu_seconds=cpu,
        tiers=tuple(
            TierResult(
                name=tier.medium,
                capacity_blocks=tier.num_blocks,
                hits=hits_below,
                blocks_written=tier_stats.blocks_stored,
                blocks_read=hits_below,
                blocks_evicted=tier_stats.blocks_evicted,
            )
            for tier, hits_below, tier_stats in zip(
                below, tier_hits, [tier.statistics() for tier in below], strict=True
            )
        ),
    )


def _name(policy: str | type[CachePolicy]) -> str:
    return policy if isinstance(policy, str) else f"{policy.__module__}:{policy.__qualname__}"
