"""The CPU offloading manager (seed chapter 4), built for the scheduler's hot path.

State is split so that the common case costs no per-block Python objects:

* the policy maps key -> block id (one ``OrderedDict`` entry and one int);
* ``_writing`` maps each key whose store is in flight (ref_cnt -1) to the
  :class:`~aiokvo.specs.StoreReservation` that reserved it;
* ``_pinned`` is the set of keys with a pending load (ref_cnt > 0), and
  ``_extra_pins`` counts the loads beyond the first (ref_cnt - 1 when >= 2);
* a key in none of them is ready and idle (ref_cnt 0).

``_writing`` and ``_pinned`` only hold blocks that are in motion, so they stay
small, and "is this block evictable?" is two C-level membership tests. Each
operation is one pass of ``map``/``filter``/``dict`` builtins over its keys.
Decisions are exactly the seed's; see docs/manager.md.

``recency="request"`` selects vLLM 0.32's rules instead: the manager records
what each request loads and offers (:mod:`aiokvo.manager.requests`) and
applies it once in :meth:`CPUOffloadingManager.on_request_finished`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Container, Iterable, Sequence
from itertools import compress, filterfalse, islice, repeat
from operator import is_

import numpy as np

from aiokvo._util import check_choice, check_int
from aiokvo.errors import BlockNotReadyError, StaleReservationError, UnknownKeyError
from aiokvo.keys import (
    GROUP_IDX_BYTES,
    MAX_KEY_BYTES,
    OffloadKey,
    check_keys,
    describe_key,
    key_sequence,
)
from aiokvo.manager.base import OffloadingManager, StoreRefusal
from aiokvo.manager.policies.base import (
    RECENCY_MODES,
    WRITING,
    BlockStatus,
    CachePolicy,
    Evicted,
    Recency,
)
from aiokvo.manager.policies.registry import resolve_policy
from aiokvo.manager.requests import KeyPosition, finish_access, request_access
from aiokvo.manager.retention import Retention
from aiokvo.manager.sink import EventSink
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.specs import (
    CPULoadStoreSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    StoreReservation,
)

__all__ = ["CPUOffloadingManager"]


_NO_IDS = np.empty(0, dtype=np.int64)
_NO_IDS.flags.writeable = False


def _cpu_spec(block_ids: list[int]) -> CPULoadStoreSpec:
    """A ``CPULoadStoreSpec`` for ids this manager allocated.

    Skips the constructor's validation (a third of a request's cost): the
    ids are non-negative ints by construction. Like a validated spec's, the
    array is read-only; the shared empty one can serve every empty spec.
    """
    spec = CPULoadStoreSpec.__new__(CPULoadStoreSpec)
    if block_ids:
        ids = np.array(block_ids, dtype=np.int64)
        ids.setflags(write=False)  # cheaper than ``ids.flags.writeable = False``
        spec.block_ids = ids
    else:
        spec.block_ids = _NO_IDS
    return spec


class CPUOffloadingManager(OffloadingManager):
    """Offloads blocks to a pool of ``num_blocks`` CPU blocks.

    Block ids are handed out as the seed does: never-used ids in increasing
    order first, then freed ids, the most recently freed first.

    Every entry point refuses a bare key where a list is expected, and
    anything that is not an ``OffloadKey``, with
    :class:`~aiokvo.errors.InvalidKeyError` before changing anything. Keys
    found in the pool were checked when they were stored, so only keys that
    are not found are checked on the hot path (docs/manager.md).

    ``recency`` is ``"touch"`` (the seed's: recency comes from
    :meth:`touch`) or ``"request"`` (vLLM 0.32's: each request's loads and
    offers are applied once, by :meth:`on_request_finished`; see
    docs/manager.md, "Recency modes").
    """

    medium = CPULoadStoreSpec.medium()

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str | type[CachePolicy] = "lru",
        enable_events: bool = False,
        *,
        recency: Recency = "touch",
    ) -> None:
        num_blocks = check_int("num_blocks", num_blocks, minimum=0)
        self._recency: Recency = check_choice("recency", recency, RECENCY_MODES)
        self._by_request = self._recency == "request"
        self._generation = 0  # bumped by reset_cache: older request records are stale
        self._num_blocks = num_blocks
        self._num_allocated = 0
        self._free_ids: list[int] = []
        self._policy: CachePolicy = resolve_policy(cache_policy)(num_blocks)
        self._policy.recency = self._recency
        # ``lookup`` probes these inline: no Python-level call per key.
        self._table_a, self._table_b = self._policy.membership_tables()
        self._writing: dict[OffloadKey, StoreReservation] = {}
        self._writing_keys = self._writing.keys()  # a live view, for isdisjoint
        self._pinned: set[OffloadKey] = set()
        self._extra_pins: dict[OffloadKey, int] = {}
        self._sink = EventSink(record=enable_events)
        self._token = object()  # what this manager's open reservations hold
        # Counters for statistics(): plain int adds, one or two per call.
        self._lookups = 0
        self._lookup_hits = 0
        self._lookup_misses = 0
        self._lookup_in_flight = 0
        self._loads = 0
        self._blocks_pinned = 0
        self._stores = 0
        self._stores_refused = 0
        self._blocks_reserved = 0
        self._blocks_stored = 0
        self._blocks_store_failed = 0
        self._blocks_evicted = 0
        self._refusal: StoreRefusal | None = None
        self._retention: Retention | None = None
        self._removed = 0

    # -- introspection ---------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Size of the CPU pool, in blocks."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out without evicting anything."""
        return len(self._free_ids) + self._num_blocks - self._num_allocated

    @property
    def recency(self) -> Recency:
        """``"touch"`` or ``"request"``: when the policy learns that keys were used."""
        return self._recency

    @property
    def policy(self) -> CachePolicy:
        """The policy instance ordering the cached blocks (read it, don't drive it)."""
        return self._policy

    def __len__(self) -> int:
        return len(self._policy)

    def statistics(self) -> ManagerStatistics:
        return ManagerStatistics(
            num_blocks=self._num_blocks,
            used_blocks=len(self._policy),
            free_blocks=self.num_free_blocks,
            writing_blocks=len(self._writing),
            pinned_blocks=len(self._pinned),
            lookups=self._lookups,
            lookup_hits=self._lookup_hits,
            lookup_misses=self._lookup_misses,
            lookup_in_flight=self._lookup_in_flight,
            loads=self._loads,
            blocks_pinned=self._blocks_pinned,
            stores=self._stores,
            stores_refused=self._stores_refused,
            blocks_reserved=self._blocks_reserved,
            blocks_stored=self._blocks_stored,
            blocks_store_failed=self._blocks_store_failed,
            blocks_evicted=self._blocks_evicted,
        )

    def block_status(self, key: OffloadKey) -> BlockStatus | None:
        """A snapshot of ``key``'s block, or None when it is not offloaded."""
        block_id = self._get(key, "block_status")
        if block_id is None:
            return None
        if key in self._writing:
            return BlockStatus(block_id, WRITING)
        if key in self._pinned:
            return BlockStatus(block_id, 1 + self._extra_pins.get(key, 0))
        return BlockStatus(block_id, 0)

    @property
    def store_refusal(self) -> StoreRefusal | None:
        return self._refusal

    def _get(self, key: OffloadKey, what: str) -> int | None:
        try:
            block_id = self._policy.get(key)
        except TypeError:  # unhashable
            block_id = None
        if block_id is None:
            check_keys((key,), what)
        return block_id

    # -- lookups ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        try:
            absent = key not in self._table_a and key not in self._table_b
        except TypeError:  # unhashable: certainly not a key
            check_keys((key,), "lookup")
            raise
        if absent:
            if type(key) is not bytes or not GROUP_IDX_BYTES < len(key) <= MAX_KEY_BYTES:
                check_keys((key,), "lookup")
            self._lookups += 1
            self._lookup_misses += 1
            return False
        self._lookups += 1
        if key in self._writing:
            self._lookup_in_flight += 1
            return None
        self._lookup_hits += 1
        return True

    def lookup_prefix(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> int | None:
        if type(keys) is not list and type(keys) is not tuple:  # the check, inlined
            keys = key_sequence(keys, "lookup_prefix")
        try:
            hits = self._policy.prefix_len(keys)
        except TypeError:
            check_keys(keys, "lookup_prefix")
            raise
        if hits < len(keys):  # the key it stopped at was not found, so not checked yet
            check_keys((keys[hits],), "lookup_prefix")
        self._lookups += 1
        # Every key of the cached prefix is ready unless one is being written;
        # then the loop form would have stopped there and answered None.
        if self._writing and not self._writing_keys.isdisjoint(islice(keys, hits)):
            self._lookup_in_flight += 1
            return None
        self._lookup_hits += hits
        if hits < len(keys):
            self._lookup_misses += 1
        return hits

    # -- loads -----------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        if type(keys) is not list and type(keys) is not tuple:  # the check, inlined
            keys = key_sequence(keys, "prepare_load")
        try:
            block_ids = self._policy.block_ids(keys)
        except (KeyError, TypeError):
            raise self._load_error(keys) from None
        if self._writing and not self._writing_keys.isdisjoint(keys):
            raise self._load_error(keys)
        self._loads += 1
        self._blocks_pinned += len(keys)
        if self._by_request:
            request_access(req_context, self, self._generation).record(keys, reused=keys)
        pinned = self._pinned
        if not self._extra_pins and (not pinned or pinned.isdisjoint(keys)):
            before = len(pinned)
            pinned.update(keys)
            if len(pinned) - before == len(keys):
                return _cpu_spec(block_ids)
            pinned.difference_update(keys)  # a key listed twice: count it properly
        self._pin_slow(keys)
        return _cpu_spec(block_ids)

    def _pin_slow(self, keys: Iterable[OffloadKey]) -> None:
        pinned, extra = self._pinned, self._extra_pins
        for key in keys:
            if key in pinned:
                extra[key] = extra.get(key, 0) + 1
            else:
                pinned.add(key)

    def _load_error(self, keys: Sequence[OffloadKey]) -> UnknownKeyError | BlockNotReadyError:
        check_keys(keys, "prepare_load")
        for key in keys:
            if key not in self._policy:
                return UnknownKeyError(
                    f"cannot load {describe_key(key)}: it is not offloaded"
                )
            if key in self._writing:
                return BlockNotReadyError(
                    f"cannot load {describe_key(key)}: it is still being written"
                )
        raise AssertionError("_load_error called without a bad key")

    def touch(self, keys: Collection[OffloadKey]) -> None:
        if type(keys) is not list and type(keys) is not tuple:  # the check, inlined
            keys = key_sequence(keys, "touch")
        # Absent keys are ignored, so they are checked here: held keys were
        # checked when stored, and one C-level probe per key finds the others.
        a, b = self._table_a, self._table_b
        try:
            absent = filterfalse(a.__contains__, keys)
            if b:
                absent = filterfalse(b.__contains__, absent)
            missing = list(absent)
            if missing:
                check_keys(missing, "touch")
        except TypeError:  # unhashable
            check_keys(keys, "touch")
            raise
        self._policy.touch(keys, self._writing)

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        """Release one pin per key; a key without a pending load raises.

        Raises :class:`UnknownKeyError` for a key that is not offloaded and
        :class:`BlockNotReadyError` for one with no pending load left, in
        both cases before releasing anything.
        """
        if type(keys) is not list and type(keys) is not tuple:  # the check, inlined
            keys = key_sequence(keys, "complete_load")
        pinned = self._pinned
        try:
            usual = not self._extra_pins and pinned.issuperset(keys)
        except TypeError:
            usual = False
        if usual:
            before = len(pinned)
            pinned.difference_update(keys)
            if before - len(pinned) == len(keys):
                return
            pinned.update(keys)  # a key listed twice: undo, then report it
        self._unpin_slow(keys)

    def _unpin_slow(self, keys: Sequence[OffloadKey]) -> None:
        check_keys(keys, "complete_load")
        pinned, extra = self._pinned, self._extra_pins
        releases: dict[OffloadKey, int] = {}
        for key in keys:
            wanted = releases.get(key, 0) + 1
            held = 1 + extra.get(key, 0) if key in pinned else 0
            if held < wanted:
                if key not in self._policy:
                    raise UnknownKeyError(
                        f"cannot complete load of {describe_key(key)}: not offloaded"
                    )
                raise BlockNotReadyError(
                    f"cannot complete load of {describe_key(key)}: it has no pending load"
                )
            releases[key] = wanted
        for key, released in releases.items():
            left = 1 + extra.pop(key, 0) - released
            if left == 0:
                pinned.discard(key)
            elif left > 1:
                extra[key] = left - 1

    # -- stores ----------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if type(keys) is not list and type(keys) is not tuple:  # the check, inlined
            keys = key_sequence(keys, "prepare_store")
        # Keys already held are skipped; a key listed twice is stored once.
        # The same dict later serves as the set of protected keys.
        try:
            named = dict.fromkeys(keys)
        except TypeError:
            check_keys(keys, "prepare_store")
            raise
        new_keys = self._policy.uncached(named)
        if new_keys:
            check_keys(new_keys, "prepare_store")  # the only keys this call adds
        self._stores += 1
        self._refusal = None
        if self._by_request:
            self._record_offer(named, new_keys, req_context)
        if not new_keys:
            return PrepareStoreOutput([], _cpu_spec([]), [], StoreReservation((), self._token))

        free_ids = self._free_ids
        free = len(free_ids) + self._num_blocks - self._num_allocated
        shortfall = len(new_keys) - free
        evicted_keys: list[OffloadKey] = []
        if shortfall > 0:
            # Everything named by this call is protected, present or not.
            exclude: list[Container[OffloadKey]] = [named]
            if self._writing:
                exclude.append(self._writing)
            if self._pinned:
                exclude.append(self._pinned)
            retention = self._retention
            if retention is not None and len(retention):
                evicted = self._evict_around(shortfall, exclude, retention)
            else:
                evicted = self._policy.evict(shortfall, exclude)
            if evicted is None:
                self._stores_refused += 1
                self._refusal = StoreRefusal(len(new_keys), free, self._num_blocks)
                return None
            evicted_keys, freed_ids = evicted
            free_ids += freed_ids
            self._blocks_evicted += len(evicted_keys)
            if self._sink.active:
                self._sink.publish(OffloadingEvent(list(evicted_keys), self.medium, True))

        block_ids = self._allocate(len(new_keys))
        self._policy.insert(new_keys, block_ids)
        reservation = StoreReservation(new_keys, self._token)
        writing = self._writing
        for key in new_keys:
            writing[key] = reservation
        self._blocks_reserved += len(new_keys)
        if self._by_request:
            request_access(req_context, self, self._generation).inserted.update(new_keys)
        return PrepareStoreOutput(new_keys, _cpu_spec(block_ids), evicted_keys, reservation)

    def _evict_around(
        self, n: int, exclude: list[Container[OffloadKey]], retention: Retention
    ) -> Evicted | None:
        """``n`` victims, unretained blocks first, then retained ones, lowest priority
        first (each stage in the policy's own order); all or nothing."""
        bands = retention.bands()
        policy = self._policy
        victims: list[OffloadKey] = []
        ids: list[int] = []
        # Stage k protects the k highest bands: all of them first, then fewer.
        for kept in range(len(bands), -1, -1):
            left = n - len(victims)
            stage = exclude + bands[:kept]
            taken = policy.evict(left, stage) if kept == 0 else self._evict_some(left, stage)
            if taken is not None:
                victims += taken[0]
                ids += taken[1]
            if len(victims) == n:
                retention.evicted_retained += sum(1 for k in victims if k in retention)
                return victims, ids
        if victims:  # the last stage could not finish: put the first stages' back
            policy.insert(victims, ids)
        return None

    def _evict_some(self, n: int, exclude: list[Container[OffloadKey]]) -> Evicted | None:
        """Up to ``n`` victims outside ``exclude``: as many as the policy gives (an
        all-or-nothing policy is asked for fewer each time it says no)."""
        victims: list[OffloadKey] = []
        ids: list[int] = []
        want = n
        while want > 0 and len(victims) < n:
            taken = self._policy.evict(want, exclude)
            if taken is None:
                want //= 2
                continue
            victims += taken[0]
            ids += taken[1]
            want = min(want, n - len(victims))
        return (victims, ids) if victims else None

    @property
    def blocks_removed(self) -> int:
        """Keys dropped by :meth:`remove` so far."""
        return self._removed

    def remove(self, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        """Drop the ready, idle ``keys`` and free their blocks; the keys dropped.

        Keys being written or read are skipped (the call that holds them
        completes them; ask again then), and unknown keys are ignored. Each
        drop is published as a removal. A tier drops bad blocks this way; the
        Offloader's ``demote`` drops blocks a tier below holds.
        """
        keys = key_sequence(keys, "remove")
        check_keys(keys, "remove")
        writing, pinned, policy = self._writing, self._pinned, self._policy
        gone = [
            k for k in dict.fromkeys(keys) if k in policy and k not in writing and k not in pinned
        ]
        if not gone:
            return gone
        self._free_ids += policy.block_ids(gone)
        policy.remove(gone)
        self._removed += len(gone)
        if self._sink.active:
            self._sink.publish(OffloadingEvent(list(gone), self.medium, True))
        return gone

    def set_retention(self, retention: Retention | None) -> None:
        """Evict the blocks ``retention`` holds after all others (None: no retention)."""
        self._retention = retention

    @property
    def retention(self) -> Retention | None:
        return self._retention

    def _record_offer(
        self, named: dict[OffloadKey, None], new_keys: list[OffloadKey], req_context: ReqContext
    ) -> None:
        """Per-request recency: note an offer before anything is allocated (vLLM 0.32).

        New keys are a store miss for the policy (ARC's ghost hits), once
        per key per request, whether or not the store then fits. New keys
        and keys already ready are the request's use; ready ones are reuse.
        Keys still being written are neither.
        """
        access = request_access(req_context, self, self._generation)
        misses = [key for key in new_keys if key not in access.store_misses]
        if misses:
            self._policy.on_store_miss(misses)
            access.store_misses.update(misses)
        new, writing = set(new_keys), self._writing
        used = [key for key in named if key in new or key not in writing]
        access.record(used, reused=[key for key in used if key not in new])

    def _allocate(self, count: int) -> list[int]:
        fresh = min(count, self._num_blocks - self._num_allocated)
        start = self._num_allocated
        block_ids = list(range(start, start + fresh))
        self._num_allocated = start + fresh
        reused = count - fresh
        if reused:
            free_ids = self._free_ids
            assert len(free_ids) >= reused, "eviction freed too few blocks"
            tail = free_ids[-reused:]
            del free_ids[-reused:]
            tail.reverse()  # last freed first, as a pop() loop would
            block_ids += tail
        return block_ids

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        """Make written blocks readable, or release them when the copy failed.

        ``keys`` is either the ``reservation`` of a :class:`PrepareStoreOutput`,
        which completes exactly the keys it still holds (and raises
        :class:`~aiokvo.errors.StaleReservationError`, changing nothing, when
        it was already completed or is not this manager's), or a list of keys
        (the seed's contract: keys that are unknown or already ready are
        ignored, and any key being written is completed, whoever reserved it).
        """
        if type(keys) is StoreReservation:
            self._complete_reservation(keys, success)
            return
        if type(keys) is not list and type(keys) is not tuple:  # the check, inlined
            keys = key_sequence(keys, "complete_store")
        writing = self._writing
        try:
            done = list(filter(writing.__contains__, keys))
        except TypeError:
            done = []
        if len(done) != len(keys):  # keys not being written: ignored, but checked
            check_keys(keys, "complete_store")
        if not done:
            return
        # Each key leaves the reservation that holds it (a key listed twice pops None).
        owners = list(map(writing.pop, done, repeat(None)))
        first = owners[0]
        assert first is not None, "the first key of done is being written"
        if owners.count(first) == len(owners):  # the usual case: one reservation
            first._held -= len(owners)
        else:
            for owner in owners:
                if owner is not None:
                    owner._held -= 1
            done = list(dict.fromkeys(done))
        self._finish_store(done, success)

    def _complete_reservation(self, reservation: StoreReservation, success: bool) -> None:
        if reservation._holder is not self._token:
            if reservation.completed:
                why = "it was already completed"
            elif reservation.open:
                why = "it belongs to another manager"
            else:
                why = "no manager holds it (it is a key list: complete its keys)"
            raise StaleReservationError(
                f"cannot complete {reservation!r}: {why}; nothing was changed"
            )
        held, owned = reservation._held, reservation.keys
        reservation._complete()
        if held == len(owned):  # the usual case: nobody completed any of them by key
            if not held:
                return
            deque(map(self._writing.pop, owned), maxlen=0)
            done: Sequence[OffloadKey] = owned
        elif held:
            # Only the keys this very reservation still holds: a key completed
            # by a key list and reserved again since belongs to someone else.
            writing = self._writing
            done = list(compress(owned, map(is_, map(writing.get, owned), repeat(reservation))))
            deque(map(writing.pop, done), maxlen=0)
        else:
            return
        self._finish_store(done, success)

    def _finish_store(self, done: Sequence[OffloadKey], success: bool) -> None:
        if success:
            self._blocks_stored += len(done)
            if self._sink.active:
                keys = done if type(done) is list else list(done)
                self._sink.publish(OffloadingEvent(keys, self.medium, False))
        else:
            self._blocks_store_failed += len(done)
            freed_ids = self._policy.block_ids(done)
            self._policy.remove(done)
            self._free_ids += freed_ids

    # -- requests and resets ---------------------------------------------------

    def on_request_finished(
        self, req_context: ReqContext, position: KeyPosition | None = None
    ) -> None:
        """With ``recency="request"``: apply the request's use of its keys, once.

        The keys it loaded or offered (and that were stored or ready) go to
        the policy in prefix order (:meth:`RequestAccess.ordered
        <aiokvo.manager.requests.RequestAccess.ordered>` with ``position``),
        split into the ones it only stored and the ones it reused. A second
        call, or one for a context this manager recorded nothing on (or
        only before a :meth:`reset_cache`), does nothing; so does every call
        with ``recency="touch"``.
        """
        if not self._by_request:
            return
        access = finish_access(req_context, self, self._generation)
        if access is None:
            return
        keys = access.ordered(position)
        if keys:
            self._policy.on_request_finished(
                keys, access.inserted - access.reused, access.reused, self._writing
            )

    def reset_cache(self, *, announce: bool = True) -> None:
        """Drop every block, ready or in motion, and the policy's history.

        Block ids start again from 0 and every request's record is dropped,
        as vLLM 0.32's ``reset_cache`` does. Transfers prepared before the
        reset must have finished before their blocks are reused, and must
        not be completed afterwards (vLLM's scheduler flushes them and drops
        their completions). With ``announce`` (and events on), one
        ``removed=True`` event lists the ready keys that were dropped, so a
        subscriber's view stays right; vLLM's integration passes
        ``announce=False`` because vLLM announces ``AllBlocksCleared`` itself.
        """
        writing = self._writing
        dropped = (
            [key for key, _ in self._policy.items() if key not in writing]
            if announce and self._sink.active
            else []
        )
        self._policy.clear()
        writing.clear()
        self._pinned.clear()
        self._extra_pins.clear()
        self._free_ids.clear()
        self._num_allocated = 0
        self._generation += 1
        if dropped:
            self._sink.publish(OffloadingEvent(dropped, self.medium, True))
