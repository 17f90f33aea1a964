"""The CPU offloading manager (seed chapter 4), built for the scheduler's hot path.

State is split so that the common case costs no per-block Python objects:

* the policy maps key -> block id (one ``OrderedDict`` entry and one int);
* ``_writing`` is the set of keys whose store is in flight (ref_cnt -1);
* ``_pins`` counts pending loads per key (ref_cnt > 0);
* a key in neither is ready and idle (ref_cnt 0).

``_writing`` and ``_pins`` only hold blocks that are in motion, so they stay
small, and "is this block evictable?" is two C-level membership tests. Each
operation is one pass of ``map``/``filter``/``dict`` builtins over its keys.
Decisions are exactly the seed's; see docs/manager.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Container, Iterable, Sequence
from itertools import filterfalse, islice

from aiokvo.errors import BlockNotReadyError, ConfigError, UnknownKeyError
from aiokvo.keys import OffloadKey
from aiokvo.manager.base import EventSink, OffloadingManager
from aiokvo.manager.policies.base import WRITING, BlockStatus, CachePolicy
from aiokvo.manager.policies.registry import resolve_policy
from aiokvo.specs import CPULoadStoreSpec, OffloadingEvent, PrepareStoreOutput, ReqContext

__all__ = ["CPUOffloadingManager"]


def _as_sequence(keys: Iterable[OffloadKey]) -> Sequence[OffloadKey]:
    return keys if isinstance(keys, (list, tuple)) else list(keys)


class CPUOffloadingManager(OffloadingManager):
    """Offloads blocks to a pool of ``num_blocks`` CPU blocks.

    Block ids are handed out as the seed does: never-used ids in increasing
    order first, then freed ids, the most recently freed first.
    """

    medium = CPULoadStoreSpec.medium()

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str | type[CachePolicy] = "lru",
        enable_events: bool = False,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise ConfigError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._num_allocated = 0
        self._free_ids: list[int] = []
        self._policy: CachePolicy = resolve_policy(cache_policy)(num_blocks)
        self._is_cached = self._policy.membership()
        self._writing: set[OffloadKey] = set()
        self._pins: dict[OffloadKey, int] = {}
        self._sink = EventSink(record=enable_events)

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
    def policy(self) -> CachePolicy:
        """The policy instance ordering the cached blocks (read it, don't drive it)."""
        return self._policy

    def __len__(self) -> int:
        return len(self._policy)

    def block_status(self, key: OffloadKey) -> BlockStatus | None:
        """A snapshot of ``key``'s block, or None when it is not offloaded."""
        block_id = self._policy.get(key)
        if block_id is None:
            return None
        ref_cnt = WRITING if key in self._writing else self._pins.get(key, 0)
        return BlockStatus(block_id, ref_cnt)

    # -- lookups ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        if not self._is_cached(key):
            return False
        return None if key in self._writing else True

    def lookup_prefix(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> int | None:
        keys = _as_sequence(keys)
        hits = self._policy.prefix_len(keys)
        # Every key of the cached prefix is ready unless one is being written;
        # then the loop form would have stopped there and answered None.
        writing = self._writing
        if writing and not writing.isdisjoint(islice(keys, hits)):
            return None
        return hits

    # -- loads -----------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        keys = _as_sequence(keys)
        try:
            block_ids = self._policy.block_ids(keys)
        except KeyError:
            raise self._load_error(keys) from None
        writing = self._writing
        if writing and not writing.isdisjoint(keys):
            raise self._load_error(keys)
        pins = self._pins
        if pins.keys().isdisjoint(keys):
            first_pins = dict.fromkeys(keys, 1)
            if len(first_pins) == len(keys):
                pins.update(first_pins)
                return CPULoadStoreSpec(block_ids)
        get = pins.get
        for key in keys:
            pins[key] = get(key, 0) + 1
        return CPULoadStoreSpec(block_ids)

    def _load_error(self, keys: Iterable[OffloadKey]) -> UnknownKeyError | BlockNotReadyError:
        for key in keys:
            if not self._is_cached(key):
                return UnknownKeyError(f"cannot load key {key!r}: it is not offloaded")
            if key in self._writing:
                return BlockNotReadyError(f"cannot load key {key!r}: it is still being written")
        raise AssertionError("_load_error called without a bad key")

    def touch(self, keys: Collection[OffloadKey]) -> None:
        self._policy.touch(_as_sequence(keys), self._writing)

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        """Release one pin per key; a key without a pending load raises.

        Raises :class:`UnknownKeyError` for a key that is not offloaded and
        :class:`BlockNotReadyError` for one with no pending load left, in
        both cases before releasing anything.
        """
        keys = _as_sequence(keys)
        pins = self._pins
        counts = list(map(pins.get, keys))
        if counts.count(1) == len(counts):  # each key pinned once: the usual case
            try:
                deque(map(pins.__delitem__, keys), maxlen=0)
                return
            except KeyError:  # a key listed twice: undo, then report it
                pins.update(dict.fromkeys(keys, 1))
        self._complete_load_slow(keys)

    def _complete_load_slow(self, keys: Sequence[OffloadKey]) -> None:
        pins = self._pins
        releases: dict[OffloadKey, int] = {}
        for key in keys:
            wanted = releases.get(key, 0) + 1
            if pins.get(key, 0) < wanted:
                if not self._is_cached(key):
                    raise UnknownKeyError(f"cannot complete load of key {key!r}: not offloaded")
                raise BlockNotReadyError(
                    f"cannot complete load of key {key!r}: it has no pending load"
                )
            releases[key] = wanted
        for key, released in releases.items():
            left = pins[key] - released
            if left:
                pins[key] = left
            else:
                del pins[key]

    # -- stores ----------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = _as_sequence(keys)
        # Keys already held are skipped; a key listed twice is stored once.
        new_keys = list(dict.fromkeys(filterfalse(self._is_cached, keys)))
        if not new_keys:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])

        shortfall = len(new_keys) - self.num_free_blocks
        evicted_keys: list[OffloadKey] = []
        if shortfall > 0:
            # Everything named by this call is protected, present or not.
            exclude: list[Container[OffloadKey]] = [set(keys)]
            if self._writing:
                exclude.append(self._writing)
            if self._pins:
                exclude.append(self._pins)
            evicted = self._policy.evict(shortfall, exclude)
            if evicted is None:
                return None
            evicted_keys, freed_ids = evicted
            self._free_ids += freed_ids
            if self._sink.active:
                self._sink.publish(OffloadingEvent(list(evicted_keys), self.medium, True))

        block_ids = self._allocate(len(new_keys))
        self._policy.insert(new_keys, block_ids)
        self._writing.update(new_keys)
        return PrepareStoreOutput(new_keys, CPULoadStoreSpec(block_ids), evicted_keys)

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

        Keys that are unknown or already ready are ignored, as in the seed.
        """
        writing = self._writing
        if not writing:
            return
        done = list(filter(writing.__contains__, _as_sequence(keys)))
        if not done:
            return
        before = len(writing)
        writing.difference_update(done)
        if before - len(writing) != len(done):
            done = list(dict.fromkeys(done))
        if success:
            if self._sink.active:
                self._sink.publish(OffloadingEvent(done, self.medium, False))
        else:
            freed_ids = self._policy.block_ids(done)
            self._policy.remove(done)
            self._free_ids += freed_ids
