"""aiokvo's manager behind vLLM's ``OffloadingManager`` ABC (0.32, 0.33): translation only.

Every decision is the wrapped aiokvo manager's, built with vLLM 0.32's rules
(``recency="request"``, and ``counting="offers"`` when ``store_threshold >=
2``). This class converts the values that cross: ``LookupResult``, vLLM's
``CPULoadStoreSpec`` (int32 chunk ids), ``PrepareStoreOutput``,
``OffloadingEvent`` (``Medium.CPU``), the per-request context (vLLM's
``ReqContext`` carries an aiokvo one in its state), and the stats vLLM's
Prometheus logger expects (:mod:`aiokvo.integrations.vllm.metrics`).

On vLLM 0.33 it also answers ``config_info`` (``vllm:kv_offload_config_info``),
releases the keys of a failed store with a ``metadata_only`` removal event
(as 0.33's CPU manager does), and reads the orchestrator hints
(``ReqContext.kv_hints``, :mod:`~aiokvo.integrations.vllm.hints`): a
``kv.retain`` retains the request's blocks softly when it finishes;
``kv.demote`` and ``kv.durable`` commit them to a tier then (with tiers,
:mod:`~aiokvo.integrations.vllm.tiering`); prefetch, those two without
tiers, and unknown actions are counted as ignored; a bad payload is
counted and logged once, never raised into the engine. ``lock`` is vLLM's
default (no lock): the manager is entered from the scheduler's thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
from vllm.v1.kv_offload.base import OffloadingEvent as VllmOffloadingEvent
from vllm.v1.kv_offload.base import OffloadingManager as VllmOffloadingManager
from vllm.v1.kv_offload.base import PrepareStoreOutput as VllmPrepareStoreOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from aiokvo.integrations.vllm._compat import has_metadata_only_events
from aiokvo.integrations.vllm.convert import (
    cpu_spec_to_vllm,
    event_to_vllm,
    lookup_result,
    tier_place,
)
from aiokvo.integrations.vllm.failures import StoreFailures
from aiokvo.integrations.vllm.hints import Demote, Durable, Refused, Retain, read_action
from aiokvo.integrations.vllm.metrics import (
    ALLOCATION_SIZE,
    BREAKER_STATES,
    CACHE_READ_USAGE,
    CACHE_USAGE,
    CACHE_WRITE_USAGE,
    KV_HINTS_EXECUTED,
    KV_HINTS_IGNORED,
    KV_HINTS_INVALID,
    STORE_FAILURES,
    STORES_SKIPPED,
    TIER_BREAKER_STATE,
    TIER_COUNTERS,
    TIER_PROMOTIONS_NO_ROOM,
    TIER_USED_BLOCKS,
    TIER_WRITES_SKIPPED,
)
from aiokvo.integrations.vllm.tiering import SchedulerTiers
from aiokvo.keys import OffloadKey
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.retention import Retention
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import ReqContext
from aiokvo.tiers.base import Tier

__all__ = ["AiokvoOffloadingManager"]

_log = logging.getLogger("aiokvo.integrations.vllm")

_LOOKUP_CONTEXT = ReqContext()  # aiokvo's lookup reads no context; skip the per-key fetch
_METADATA_ONLY = has_metadata_only_events(VllmOffloadingEvent)
_CPU = Medium.CPU
_HIT_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY
try:  # vLLM 0.33: a request's filter over the tiers below the pool
    from vllm.v1.kv_offload.base import TierFilter as _TierFilter

    _ALL_TIERS: Any = _TierFilter.ALL
except ImportError:  # 0.32 has none
    _ALL_TIERS = None


def _allows(flt: Any, medium: str) -> bool:
    return bool(flt.allows(*tier_place(medium)))


class _Request:
    """The aiokvo context of one vLLM request, kept in vLLM's ``ReqContext`` state;
    with a ``kv.retain`` hint, the keys it used, to retain when it finishes."""

    __slots__ = ("commits", "context", "keys", "retain")

    def __init__(self, kv_transfer_params: dict[str, Any] | None) -> None:
        self.context = ReqContext(kv_transfer_params=kv_transfer_params)
        self.retain: Retain | None = None
        self.commits: list[tuple[Tier, bool]] = []  # kv.durable / kv.demote: (tier, evict)
        self.keys: dict[OffloadKey, None] | None = None


def _request(req_context: Any) -> _Request:
    state: _Request | None = req_context.get_state(_Request)
    if state is None:  # a request the connector did not announce (vLLM does for untracked ones)
        state = _Request(req_context.kv_transfer_params)
        req_context.set_state(state)
    return state


def _context(req_context: Any) -> ReqContext:
    return _request(req_context).context


class AiokvoOffloadingManager(VllmOffloadingManager):  # type: ignore[misc]
    """vLLM's manager interface over an aiokvo manager; see the module docstring.

    ``store_failures`` is where the engine's workers, in any process, report
    stores that failed for good (:mod:`aiokvo.integrations.vllm.failures`):
    their keys are completed as failed, so they are never served.
    ``config_info`` is the one series of ``vllm:kv_offload_config_info``.
    """

    def __init__(
        self,
        manager: OffloadingManager,
        store_failures: StoreFailures,
        *,
        config_info: Mapping[str, Any] | None = None,
        enable_events: bool = False,
        retention: Retention | None = None,
        tiers: SchedulerTiers | None = None,
    ) -> None:
        if isinstance(manager, FilterReusedOffloadingManager):
            self._filter: FilterReusedOffloadingManager | None = manager
            core = manager.backing
        else:
            self._filter, core = None, manager
        if not isinstance(core, CPUOffloadingManager):
            raise TypeError(f"expected aiokvo's CPUOffloadingManager, got {core!r}")
        self._manager = manager
        self._core = core
        if retention is not None:  # kv.retain hints retain softly within its budget
            core.set_retention(retention)
        self._failures = store_failures
        self._tiers = tiers
        self._tier_reported: dict[tuple[str, str], int] = {}
        self._allocation_sizes: list[int] = []
        self._skipped_reported = 0
        self._failed_reported = 0
        self._config_info = dict(config_info or {})
        self._events: list[Any] = []  # vLLM events made here, in order with the manager's
        self._metadata_only_events = _METADATA_ONLY and enable_events
        # Hint actions: executed, ignored (unknown, or needing a tier), invalid payloads;
        # and how much of each get_stats has reported already.
        self._hints = {KV_HINTS_EXECUTED: 0, KV_HINTS_IGNORED: 0, KV_HINTS_INVALID: 0}
        self._hints_reported = dict.fromkeys(self._hints, 0)
        self._hint_warnings: set[tuple[str, str]] = set()

    @property
    def aiokvo_manager(self) -> OffloadingManager:
        """The aiokvo manager making the decisions (read it, don't drive it)."""
        return self._manager

    # -- requests --------------------------------------------------------------
    def on_new_request(self, req_context: Any) -> Any:
        state = _Request(req_context.kv_transfer_params)
        req_context.set_state(state)
        hints = getattr(req_context, "kv_hints", None)
        if hints is not None:
            self._read_hints(state, hints)
        return RequestOffloadingContext()

    def _read_hints(self, state: _Request, envelope: Any) -> None:
        """Read vLLM 0.33's ``KvHintsEnvelope``: keep a retain for the request's end;
        count what cannot be acted on here (never raising into the engine)."""
        actions = getattr(envelope, "actions", None)
        if not isinstance(actions, list | tuple):
            self._hint_refused(Refused("(envelope)", "bad_payload", f"actions: {actions!r}"))
            return
        for action in actions:
            hint = read_action(action)
            if isinstance(hint, Refused):
                self._hint_refused(hint)
            elif isinstance(hint, Retain) and self._core.retention is not None:
                state.retain = hint
                if state.keys is None:
                    state.keys = {}
            elif isinstance(hint, Demote | Durable) and (tier := self._hint_tier(hint)):
                state.commits.append((tier, isinstance(hint, Demote)))
                if state.keys is None:
                    state.keys = {}
            else:  # prefetch (lookups promote anyway), no tier, or no such tier
                self._hints[KV_HINTS_IGNORED] += 1

    def _hint_tier(self, hint: Demote | Durable) -> Tier | None:
        """The tier a demote (the top one) or durable (the named one, else the lowest)
        commits to; None without tiers or with no tier of that medium."""
        if self._tiers is None:
            return None
        if isinstance(hint, Demote):
            return self._tiers.tier(None)
        return self._tiers.tier(hint.tier, lowest=True)

    def _hint_refused(self, refused: Refused) -> None:
        invalid = refused.reason == "bad_payload"
        self._hints[KV_HINTS_INVALID if invalid else KV_HINTS_IGNORED] += 1
        if invalid and (refused.action_type, refused.reason) not in self._hint_warnings:
            self._hint_warnings.add((refused.action_type, refused.reason))
            _log.warning("kv_hints action %s refused (%s): %s; counted in %s from now on",
                         refused.action_type, refused.reason, refused.detail, KV_HINTS_INVALID)

    def on_request_finished(self, req_context: Any) -> None:
        state: _Request | None = req_context.get_state(_Request)
        if state is None:
            return
        self._manager.on_request_finished(state.context, req_context.get_offload_key_position)
        retain, keys = state.retain, state.keys
        retention = self._core.retention
        if retain is not None and keys and retention is not None:
            state.retain = None
            retention.retain(list(keys), priority=retain.priority, ttl=retain.ttl)
            self._hints[KV_HINTS_EXECUTED] += 1
        if state.commits and keys and self._tiers is not None:
            for tier, evict in state.commits:
                self._tiers.commit(tier, list(keys), evict=evict)
                self._hints[KV_HINTS_EXECUTED] += 1
            state.commits = []
        state.keys = None

    def on_schedule_end(self, context: Any) -> None:
        if self._tiers is not None:
            self._tiers.step()

    def has_pending_work(self) -> bool:
        return self._tiers is not None and self._tiers.has_pending_work()

    @property
    def tiers(self) -> SchedulerTiers | None:
        """The tiers below the pool (``aiokvo_tiers``), if any (read them, don't drive them)."""
        return self._tiers

    # -- lookups and loads -------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: Any) -> Any:
        found = self._manager.lookup(key, _LOOKUP_CONTEXT)
        if found is False and self._tiers is not None:
            flt = getattr(req_context, "load_tier_filter", None)  # vLLM 0.33
            allowed = None if flt is None or flt is _ALL_TIERS else partial(_allows, flt)
            answer = self._tiers.lookup(key, allowed)
            if answer == "pending":
                return _HIT_PENDING  # promoted at the end of this step; vLLM asks again
            if answer == "retry":
                return _RETRY  # a remote tier is being asked; vLLM asks again

        return lookup_result(found)

    def get_load_source(self, key: OffloadKey, req_context: Any) -> Any:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: Any) -> Any:
        state = _request(req_context)
        if state.keys is not None:
            state.keys.update(dict.fromkeys(keys))
        return cpu_spec_to_vllm(self._manager.prepare_load(keys, state.context))

    def touch(self, keys: Collection[OffloadKey], req_context: Any) -> None:
        self._manager.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: Any) -> None:
        self._manager.complete_load(keys)

    # -- stores ----------------------------------------------------------------
    def prepare_store(self, keys: Collection[OffloadKey], req_context: Any) -> Any:
        state = _request(req_context)
        if state.keys is not None:
            state.keys.update(dict.fromkeys(keys))
        out = self._manager.prepare_store(keys, state.context)
        if out is None:
            # vLLM counts a refused allocation in the histogram too.
            self._allocation_sizes.append(self._candidates(keys))
            return None
        if out.keys_to_store:
            self._allocation_sizes.append(len(out.keys_to_store))
        return VllmPrepareStoreOutput(
            keys_to_store=list(out.keys_to_store),
            store_spec=cpu_spec_to_vllm(out.store_spec),
            evicted_keys=list(out.evicted_keys),
        )

    def _candidates(self, keys: Collection[OffloadKey]) -> int:
        """How many blocks a refused store asked for: its new keys that passed the filter."""
        new = self._core.policy.uncached(dict.fromkeys(keys))
        flt = self._filter
        if flt is None:
            return len(new)
        return sum(1 for key in new if flt.counts.get(key, 0) >= flt.store_threshold)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: Any, success: bool = True
    ) -> None:
        if success and self._failures.poll():
            failed = self._failures.take(self._core, keys)
            if failed:
                self._fail_store(failed)
                keys = [key for key in keys if key not in failed]
        if success:
            self._manager.complete_store(keys, success)
            if self._tiers is not None:
                self._tiers.stored(list(keys))
        else:
            self._fail_store(keys)

    def _fail_store(self, keys: Collection[OffloadKey]) -> None:
        """Complete ``keys`` as failed; on vLLM 0.33, announce the release of those
        that were being written with a ``metadata_only`` removal, as its manager does."""
        if not self._metadata_only_events:
            self._manager.complete_store(keys, success=False)
            return
        core = self._core
        freed = [k for k in keys if (st := core.block_status(k)) is not None and not st.is_ready]
        self._manager.complete_store(keys, success=False)
        if freed:
            self._events.extend(event_to_vllm(e) for e in self._manager.take_events())
            self._events.append(
                VllmOffloadingEvent(keys=freed, medium=_CPU, removed=True, metadata_only=True)
            )

    # -- the rest ----------------------------------------------------------------
    def take_events(self) -> Iterable[Any]:
        made, self._events = self._events, []
        out: list[Any] = []
        for event in made:
            if getattr(event, "metadata_only", False):
                # A key stored again since its release is not announced as removed.
                keys = [k for k in event.keys if self._core.block_status(k) is None]
                if not keys:
                    continue
                event = VllmOffloadingEvent(
                    keys=keys, medium=event.medium, removed=True, metadata_only=True
                )
            out.append(event)
        out.extend(event_to_vllm(event) for event in self._manager.take_events())
        return out

    def reset_cache(self) -> None:
        # vLLM's scheduler announces AllBlocksCleared itself, and its own
        # manager publishes nothing here: no removal event (docs/vllm.md).
        self._manager.reset_cache(announce=False)
        self._failures.clear()
        if self._tiers is not None:
            self._tiers.reset()

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        """vLLM 0.33's ``vllm:kv_offload_config_info`` series: the CPU pool's facts."""
        return [dict(self._config_info)]

    def get_stats(self) -> Any:
        stats = OffloadingConnectorStats()
        pool = self._manager.statistics()
        num_blocks, writing, pinned = pool.num_blocks, pool.writing_blocks, pool.pinned_blocks
        usage = (writing + pinned) / num_blocks if num_blocks else 0.0
        write_usage = writing / num_blocks if num_blocks else 0.0
        stats.set_gauge(CACHE_USAGE, usage)
        stats.set_gauge(CACHE_WRITE_USAGE, write_usage)
        stats.set_gauge(CACHE_READ_USAGE, max(usage - write_usage, 0.0))
        for size in self._allocation_sizes:
            stats.observe_histogram(ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        if self._filter is not None:
            skipped = pool.reuse_filtered_blocks  # offers mode: vLLM's skipped stores
            stats.increase_counter(STORES_SKIPPED, skipped - self._skipped_reported)
            self._skipped_reported = skipped
        failed = self._failures.consumed
        stats.increase_counter(STORE_FAILURES, failed - self._failed_reported)
        self._failed_reported = failed
        for name, count in self._hints.items():
            if count != self._hints_reported[name]:
                stats.increase_counter(name, count - self._hints_reported[name])
                self._hints_reported[name] = count
        if self._tiers is not None:
            self._tier_stats(stats)
        return stats

    def _tier_stats(self, stats: Any) -> None:
        """Each tier's counters (deltas), used blocks and breaker state, by medium."""
        reported = self._tier_reported
        for tier in self._tiers.tier_statistics() if self._tiers is not None else ():
            labels = (tier.medium,)
            for name, (field, _) in TIER_COUNTERS.items():
                value = int(getattr(tier, field))
                delta = value - reported.get((name, tier.medium), 0)
                if delta:
                    stats.increase_counter(name, delta, labels)
                    reported[(name, tier.medium)] = value
            stats.set_gauge(TIER_USED_BLOCKS, tier.used_blocks, labels)
            stats.set_gauge(TIER_BREAKER_STATE, BREAKER_STATES.get(tier.breaker.state, 0), labels)
        if self._tiers is not None:
            own = self._tiers.statistics()
            for name, value in ((TIER_PROMOTIONS_NO_ROOM, own.promotions_no_room),
                                (TIER_WRITES_SKIPPED, own.writes_skipped)):
                delta = value - reported.get((name, ""), 0)
                if delta:
                    stats.increase_counter(name, delta)
                    reported[(name, "")] = value

    def shutdown(self) -> None:
        tiers, self._tiers = self._tiers, None
        try:
            if tiers is not None:
                tiers.close()
        finally:
            try:
                self._manager.shutdown()
            finally:
                self._failures.close()

