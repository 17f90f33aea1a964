"""A slow, obvious model of vLLM 0.32's CPU manager rules: the oracle for the new modes.

What it models, step by step (docs/manager.md, "Recency modes"):

* per request, the keys it loaded or offered (stored or ready), by group in
  the order first seen, plus which it inserted and which it reused;
* at request finish, those keys in prefix order go to the policy once;
* LRU keeps an integer rank per key (a use gives a new, higher rank) and
  evicts the evictable key with the lowest rank;
* ARC inserts into T1, promotes a reused key T1 -> T2 at finish, adapts its
  target on ghost hits of store misses (once per request per key), and
  picks victims one by one from T1 (while the shrinking T1 size is at least
  the target), else T2, else T1 again;
* the reuse filter counts offers and filters only keys that are not held.

The real manager is built for speed instead and must make the same
decisions; in the vLLM venv the shadow check also compares both with vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from aiokvo.errors import BlockNotReadyError, UnknownKeyError
from aiokvo.keys import OffloadKey, get_offload_group_idx
from aiokvo.specs import OffloadingEvent, ReqContext

WRITING = -1


class _Entry:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = WRITING


class RefLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[OffloadKey, _Entry] = {}
        self.rank: dict[OffloadKey, int] = {}
        self.clock = 0

    def get(self, key: OffloadKey) -> _Entry | None:
        return self.entries.get(key)

    def use(self, key: OffloadKey) -> None:
        if key in self.entries:
            self.clock += 1
            self.rank[key] = self.clock

    def insert(self, key: OffloadKey, entry: _Entry) -> None:
        self.entries[key] = entry
        self.use(key)

    def remove(self, key: OffloadKey) -> None:
        del self.entries[key]
        del self.rank[key]

    def store_miss(self, keys: Sequence[OffloadKey]) -> None:
        return

    def finished(self, keys: Sequence[OffloadKey], inserted: set[OffloadKey],
                 reused: set[OffloadKey]) -> None:
        for key in reversed(keys):
            self.use(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, _Entry]] | None:
        candidates = sorted(
            (self.rank[k], k)
            for k, e in self.entries.items()
            if e.ref_cnt == 0 and k not in protected
        )
        if len(candidates) < n:
            return None
        out = [(k, self.entries[k]) for _, k in candidates[:n]]
        for k, _ in out:
            self.remove(k)
        return out

    def clear(self) -> None:
        self.entries.clear()
        self.rank.clear()

    def order(self) -> list[OffloadKey]:
        return [k for _, k in sorted((r, k) for k, r in self.rank.items())]


class RefARC:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target = 0.0
        self.t1: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> _Entry | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, entry: _Entry) -> None:
        self.t1[key] = entry
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def store_miss(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.b1:
                self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def finished(self, keys: Sequence[OffloadKey], inserted: set[OffloadKey],
                 reused: set[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in inserted:
                for lst in (self.t1, self.t2):
                    if key in lst:
                        lst.move_to_end(key)
                        break
            elif key in reused:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, _Entry]] | None:
        chosen: list[tuple[OffloadKey, bool]] = []
        taken: set[OffloadKey] = set()
        virtual_t1 = len(self.t1)

        def first(lst: OrderedDict[OffloadKey, _Entry]) -> OffloadKey | None:
            for k, e in lst.items():
                if e.ref_cnt == 0 and k not in protected and k not in taken:
                    return k
            return None

        for _ in range(n):
            pick: tuple[OffloadKey, bool] | None = None
            if virtual_t1 >= int(self.target):
                k = first(self.t1)
                if k is not None:
                    pick = (k, True)
                    virtual_t1 -= 1
            if pick is None:
                k = first(self.t2)
                if k is not None:
                    pick = (k, False)
            if pick is None:
                k = first(self.t1)
                if k is None:
                    return None
                pick = (k, True)
                virtual_t1 -= 1
            chosen.append(pick)
            taken.add(pick[0])
        out = []
        for k, from_t1 in chosen:
            if from_t1:
                out.append((k, self.t1.pop(k)))
                self.b1[k] = None
            else:
                out.append((k, self.t2.pop(k)))
                self.b2[k] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return out

    def clear(self) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.clear()
        self.target = 0.0


class _Access:
    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.groups: dict[int, list[OffloadKey]] = {}
        self.seen: set[OffloadKey] = set()
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.misses: set[OffloadKey] = set()

    def record(self, keys: Sequence[OffloadKey], reused: Sequence[OffloadKey] = ()) -> None:
        for key in keys:
            if key not in self.seen:
                self.seen.add(key)
                self.groups.setdefault(get_offload_group_idx(key), []).append(key)
        self.reused |= {k for k in reused if k not in self.inserted}


Position = Callable[[OffloadKey], "int | None"]


class RefRequestManager:
    """vLLM 0.32's manager rules over :class:`RefLRU` or :class:`RefARC`."""

    def __init__(self, num_blocks: int, policy: str, *, store_threshold: int = 0,
                 max_tracker_size: int = 64_000) -> None:
        self.num_blocks = num_blocks
        self.policy: RefLRU | RefARC = RefLRU(num_blocks) if policy == "lru" else RefARC(num_blocks)
        self.allocated = 0
        self.free: list[int] = []
        self.events: list[OffloadingEvent] = []
        self.threshold = store_threshold
        self.max_tracker = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self.skipped = 0
        self.generation = 0
        self.access: dict[int, _Access] = {}

    def _state(self, ctx: ReqContext) -> _Access:
        state = self.access.get(id(ctx))
        if state is None or state.generation != self.generation:
            state = self.access[id(ctx)] = _Access(self.generation)
        return state

    # -- calls -------------------------------------------------------------------
    def lookup(self, key: OffloadKey) -> bool | None:
        entry = self.policy.get(key)
        if entry is None:
            return False
        return True if entry.ref_cnt >= 0 else None

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        entries = []
        for key in keys:
            entry = self.policy.get(key)
            if entry is None:
                raise UnknownKeyError(key)
            if entry.ref_cnt < 0:
                raise BlockNotReadyError(key)
            entries.append(entry)
        for entry in entries:
            entry.ref_cnt += 1
        self._state(ctx).record(keys, reused=keys)
        return [e.block_id for e in entries]

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            entry = self.policy.get(key)
            assert entry is not None and entry.ref_cnt > 0
            entry.ref_cnt -= 1

    def _count(self, keys: Sequence[OffloadKey]) -> None:
        protected = set()
        for key in keys:
            if key in self.counts:
                self.counts.move_to_end(key)
                self.counts[key] += 1
                protected.add(key)
        unprotected = len(self.counts) - len(protected)
        for key in keys:
            if key in self.counts:
                continue
            if len(self.counts) >= self.max_tracker:
                if unprotected == 0:
                    continue
                self.counts.popitem(last=False)
                unprotected -= 1
            self.counts[key] = 1

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> tuple[list[OffloadKey], list[int], list[OffloadKey]] | None:
        keys = list(dict.fromkeys(keys))
        if self.threshold >= 2:
            self._count(keys)
        new = [k for k in keys if self.policy.get(k) is None]
        ready = [k for k in keys if (e := self.policy.get(k)) is not None and e.ref_cnt >= 0]
        if self.threshold >= 2:
            passed = [k for k in new if self.counts.get(k, 0) >= self.threshold]
            self.skipped += len(new) - len(passed)
            new = passed
        state = self._state(ctx)
        misses = [k for k in new if k not in state.misses]
        if misses:
            self.policy.store_miss(misses)
            state.misses |= set(misses)
        state.record([k for k in keys if k in set(new) | set(ready)], reused=ready)
        if not new:
            return [], [], []
        shortfall = len(new) - (len(self.free) + self.num_blocks - self.allocated)
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            victims = self.policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            for k, e in victims:
                self.free.append(e.block_id)
                evicted.append(k)
            self.events.append(OffloadingEvent(list(evicted), "CPU", True))
        ids = []
        for key in new:
            if self.allocated < self.num_blocks:
                block_id = self.allocated
                self.allocated += 1
            else:
                block_id = self.free.pop()
            ids.append(block_id)
            self.policy.insert(key, _Entry(block_id))
        state.inserted |= set(new)
        return new, ids, evicted

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        done = []
        for key in keys:
            entry = self.policy.get(key)
            if entry is None or entry.ref_cnt >= 0:
                continue
            if success:
                entry.ref_cnt = 0
                done.append(key)
            else:
                self.policy.remove(key)
                self.free.append(entry.block_id)
        if done:
            self.events.append(OffloadingEvent(done, "CPU", False))

    def on_request_finished(self, ctx: ReqContext, position: Position | None = None) -> None:
        state = self.access.pop(id(ctx), None)
        if state is None or state.generation != self.generation:
            return
        keys: list[OffloadKey] = []
        for group in sorted(state.groups):
            members = state.groups[group]
            if position is not None and all(position(k) is not None for k in members):
                members = sorted(members, key=position)  # type: ignore[arg-type]
            keys += members
        if position is not None and all(position(k) is not None for k in keys):
            keys = sorted(keys, key=position)  # type: ignore[arg-type]
        self.policy.finished(keys, state.inserted - state.reused, state.reused)

    def reset_cache(self) -> None:
        self.policy.clear()
        self.free.clear()
        self.allocated = 0
        self.generation += 1

    # -- views -------------------------------------------------------------------
    def entries(self) -> dict[OffloadKey, tuple[int, int]]:
        if isinstance(self.policy, RefLRU):
            items = [(k, self.policy.entries[k]) for k in self.policy.order()]
        else:
            items = [*self.policy.t1.items(), *self.policy.t2.items()]
        return {k: (e.block_id, e.ref_cnt) for k, e in items}
