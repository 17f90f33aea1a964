"""A slow, obvious model of the seed's CPU offloading manager: the tests' oracle.

It follows seed chapters 3 to 5 step by step with ``OrderedDict``s so that a
reader can check it against the spec line by line; the real manager may be
built for speed instead and must produce exactly the same outputs.

Where the seed asserts, this model raises the typed errors aiokvo promises
(``UnknownKeyError``, ``BlockNotReadyError``) and, like aiokvo, it
de-duplicates repeated keys in ``prepare_store`` (keeping the first), which
the seed leaves undefined (it would hand out two blocks for one key).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from aiokvo.errors import BlockNotReadyError, ConfigError, UnknownKeyError, UnknownPolicyError
from aiokvo.keys import OffloadKey
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.sink import EventSink
from aiokvo.specs import CPULoadStoreSpec, OffloadingEvent, PrepareStoreOutput, ReqContext

__all__ = [
    "RefARC",
    "RefBlock",
    "RefCPUManager",
    "RefFilterReused",
    "RefLRU",
    "RefPolicy",
]

WRITING = -1
"""``ref_cnt`` of a block whose data is still being copied in."""


class RefBlock:
    """One pool slot: its id and its reference count (-1 writing, 0 idle, >0 read)."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = WRITING

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


Evicted = list[tuple[OffloadKey, RefBlock]]


class RefPolicy:
    """What the manager asks of a policy (seed 5.x)."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    def get(self, key: OffloadKey) -> RefBlock | None:
        raise NotImplementedError

    def insert(self, key: OffloadKey, block: RefBlock) -> None:
        raise NotImplementedError

    def remove(self, key: OffloadKey) -> None:
        raise NotImplementedError

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        raise NotImplementedError

    def evict(self, n: int, protected: set[OffloadKey]) -> Evicted | None:
        raise NotImplementedError

    def items(self) -> list[tuple[OffloadKey, RefBlock]]:
        raise NotImplementedError


class RefLRU(RefPolicy):
    """Seed 5.2: one OrderedDict, least recently used first."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: OrderedDict[OffloadKey, RefBlock] = OrderedDict()

    def get(self, key: OffloadKey) -> RefBlock | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: RefBlock) -> None:
        self.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        # Walk backwards so the first key ends up the most recently used.
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> Evicted | None:
        if n == 0:
            return []
        chosen: Evicted = []
        for key, block in self.blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                chosen.append((key, block))
                if len(chosen) == n:
                    break
        if len(chosen) < n:
            return None
        for key, _ in chosen:
            del self.blocks[key]
        return chosen

    def items(self) -> list[tuple[OffloadKey, RefBlock]]:
        return list(self.blocks.items())


class RefARC(RefPolicy):
    """Seed 5.3: T1/T2 hold blocks, B1/B2 remember keys evicted from them."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, RefBlock] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, RefBlock] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> RefBlock | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, block: RefBlock) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1.pop(key)
                if block.is_ready:
                    self.t2[key] = block  # second use: promote to "frequent"
                else:
                    self.t1[key] = block  # still being written: only refresh
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                step = max(1, len(self.b2) / len(self.b1))
                self.target_t1_size = min(self.target_t1_size + step, self.cache_capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                step = max(1, len(self.b1) / len(self.b2))
                self.target_t1_size = max(self.target_t1_size - step, 0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> Evicted | None:
        if n == 0:
            return []
        plan: list[tuple[OffloadKey, RefBlock, bool]] = []
        taken: set[OffloadKey] = set()
        virtual_t1 = len(self.t1)
        for _ in range(n):
            pick: tuple[OffloadKey, RefBlock, bool] | None = None
            if virtual_t1 >= int(self.target_t1_size):
                for key, block in self.t1.items():
                    if block.ref_cnt == 0 and key not in protected and key not in taken:
                        pick = (key, block, True)
                        virtual_t1 -= 1
                        break
            if pick is None:
                for key, block in self.t2.items():
                    if block.ref_cnt == 0 and key not in protected and key not in taken:
                        pick = (key, block, False)
                        break
                if pick is None:
                    return None
            plan.append(pick)
            taken.add(pick[0])

        evicted: Evicted = []
        for key, block, from_t1 in plan:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            evicted.append((key, block))
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.cache_capacity):
                ghosts.popitem(last=False)
        return evicted

    def items(self) -> list[tuple[OffloadKey, RefBlock]]:
        return [*self.t1.items(), *self.t2.items()]


_POLICIES: dict[str, type[RefPolicy]] = {"lru": RefLRU, "arc": RefARC}


@dataclass
class _Pool:
    """Seed 4.1's block pool: a fresh-id cursor plus a LIFO free list."""

    num_blocks: int
    num_allocated: int = 0

    def __post_init__(self) -> None:
        self.free_list: list[int] = []

    def num_free(self) -> int:
        return len(self.free_list) + self.num_blocks - self.num_allocated

    def allocate(self, count: int) -> list[RefBlock]:
        fresh = min(count, self.num_blocks - self.num_allocated)
        reused = count - fresh
        assert len(self.free_list) >= reused
        blocks = [RefBlock(self.num_allocated + i) for i in range(fresh)]
        self.num_allocated += fresh
        blocks += [RefBlock(self.free_list.pop()) for _ in range(reused)]
        return blocks

    def free(self, block: RefBlock) -> None:
        self.free_list.append(block.block_id)


class RefCPUManager(OffloadingManager):
    """Seed chapter 4's CPUOffloadingManager over :class:`RefLRU` or :class:`RefARC`."""

    medium = "CPU"

    def __init__(self, num_blocks: int, cache_policy: str = "lru", enable_events: bool = False):
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks!r}")
        policy_cls = _POLICIES.get(cache_policy)
        if policy_cls is None:
            raise UnknownPolicyError(f"unknown cache policy {cache_policy!r}")
        self.policy: RefPolicy = policy_cls(num_blocks)
        self.pool = _Pool(num_blocks)
        self._sink = EventSink(record=enable_events)

    # -- queries -------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        block = self.policy.get(key)
        if block is None:
            return False
        return True if block.is_ready else None

    # -- loads ---------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        blocks = []
        for key in keys:  # check everything first so a bad key changes nothing
            block = self.policy.get(key)
            if block is None:
                raise UnknownKeyError(f"key {key!r} is not offloaded")
            if not block.is_ready:
                raise BlockNotReadyError(f"key {key!r} is still being written")
            blocks.append(block)
        for block in blocks:
            block.ref_cnt += 1
        return CPULoadStoreSpec([block.block_id for block in blocks])

    def touch(self, keys: Collection[OffloadKey]) -> None:
        self.policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        for key in keys:
            block = self.policy.get(key)
            if block is None:
                raise UnknownKeyError(f"key {key!r} is not offloaded")
            if block.ref_cnt <= 0:
                raise BlockNotReadyError(f"key {key!r} has no pending load")
            block.ref_cnt -= 1

    # -- stores --------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        to_store = [key for key in dict.fromkeys(keys) if self.policy.get(key) is None]
        if not to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])

        shortfall = len(to_store) - self.pool.num_free()
        evicted_keys: list[OffloadKey] = []
        if shortfall > 0:
            evicted = self.policy.evict(shortfall, set(keys))
            if evicted is None:
                return None
            for key, block in evicted:
                self.pool.free(block)
                evicted_keys.append(key)
        if evicted_keys:
            self._sink.publish(OffloadingEvent(list(evicted_keys), self.medium, removed=True))

        blocks = self.pool.allocate(len(to_store))
        for key, block in zip(to_store, blocks, strict=True):
            self.policy.insert(key, block)
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=CPULoadStoreSpec([block.block_id for block in blocks]),
            evicted_keys=evicted_keys,
        )

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        stored: list[OffloadKey] = []
        for key in keys:
            block = self.policy.get(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_cnt = 0
                stored.append(key)
            else:
                self.policy.remove(key)
                self.pool.free(block)
        if stored:
            self._sink.publish(OffloadingEvent(stored, self.medium, removed=False))

    # -- introspection for the tests ------------------------------------------

    def entries(self) -> dict[OffloadKey, tuple[int, int]]:
        """Every live key mapped to ``(block_id, ref_cnt)``."""
        return {key: (block.block_id, block.ref_cnt) for key, block in self.policy.items()}

    def block_status(self, key: OffloadKey) -> RefBlock | None:
        """The live block of ``key`` (same fields as aiokvo's ``BlockStatus``)."""
        return self.policy.get(key)

    def ready_keys(self) -> set[OffloadKey]:
        return {key for key, (_, ref_cnt) in self.entries().items() if ref_cnt >= 0}


class RefFilterReused(OffloadingManager):
    """Seed chapter 3: store only keys that ``lookup`` has seen ``store_threshold`` times."""

    def __init__(
        self,
        backing: OffloadingManager,
        store_threshold: int = 2,
        max_tracker_size: int = 64_000,
    ) -> None:
        if store_threshold < 2:
            raise ConfigError(f"store_threshold must be >= 2, got {store_threshold!r}")
        if max_tracker_size < 1:
            raise ConfigError(f"max_tracker_size must be >= 1, got {max_tracker_size!r}")
        self.backing = backing
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._sink = backing._sink

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        if key in self.counts:
            self.counts.move_to_end(key)
            self.counts[key] += 1
        else:
            if len(self.counts) >= self.max_tracker_size:
                self.counts.popitem(last=False)
            self.counts[key] = 1
        return self.backing.lookup(key, req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        eligible = [key for key in keys if self.counts.get(key, 0) >= self.store_threshold]
        return self.backing.prepare_store(eligible, req_context)

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        spec = self.backing.prepare_load(keys, req_context)
        assert isinstance(spec, CPULoadStoreSpec)
        return spec

    def touch(self, keys: Collection[OffloadKey]) -> None:
        self.backing.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        self.backing.complete_load(keys)

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        self.backing.complete_store(keys, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.backing.take_events()
