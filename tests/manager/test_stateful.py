"""Random call sequences against the seed reference, checked after every step.

A hypothesis state machine drives ``lookup``, ``lookup_prefix``,
``prepare_store``, ``complete_store`` (success or failure), ``prepare_load``
(valid or not), ``complete_load`` and ``touch`` on a real manager and on
``tests/_seed_reference.py`` side by side, over a small key universe and a
small pool so eviction happens all the time. Every output must equal the
reference's, and independently of the reference the machine checks the
safety rules from the outputs alone: the pool never overflows, live block
ids are unique and in range, nothing being read or written (or named by
the call) is evicted, and replaying the event stream gives exactly the
ready keys.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from aiokvo.errors import AiokvoError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, ReqContext
from tests.manager._seed_reference import RefCPUManager, RefFilterReused

CTX = ReqContext()
KEYS = [make_offload_key(b"blk%d" % n, n % 2) for n in range(7)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=4)

SETTINGS = settings(
    max_examples=200,
    stateful_step_count=100,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


class ManagerMachine(RuleBasedStateMachine):
    """The real manager and the reference, driven in lockstep."""

    wrap_reuse = False

    impl: OffloadingManager
    ref: OffloadingManager
    impl_core: CPUOffloadingManager
    ref_core: RefCPUManager

    @initialize(
        num_blocks=st.integers(1, 5),
        policy=st.sampled_from(["lru", "arc"]),
        threshold=st.integers(2, 3),
        tracker=st.integers(1, 6),
    )
    def build(self, num_blocks: int, policy: str, threshold: int, tracker: int) -> None:
        self.num_blocks = num_blocks
        self.impl_core = CPUOffloadingManager(num_blocks, cache_policy=policy, enable_events=True)
        self.ref_core = RefCPUManager(num_blocks, cache_policy=policy, enable_events=True)
        self.impl, self.ref = self.impl_core, self.ref_core
        if self.wrap_reuse:
            self.impl = FilterReusedOffloadingManager(self.impl_core, threshold, tracker)
            self.ref = RefFilterReused(self.ref_core, threshold, tracker)
        # What the outputs alone say about the pool, kept without the reference.
        self.held: dict[OffloadKey, int] = {}
        self.writing: set[OffloadKey] = set()
        self.loads: list[list[OffloadKey]] = []
        self.replayed: set[OffloadKey] = set()
        self.evicted: set[OffloadKey] = set()

    # -- rules -----------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: OffloadKey) -> None:
        assert self.impl.lookup(key, CTX) == self.ref.lookup(key, CTX)

    @rule(keys=key_lists)
    def lookup_prefix(self, keys: list[OffloadKey]) -> None:
        assert self.impl.lookup_prefix(keys, CTX) == self.ref.lookup_prefix(keys, CTX)

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        expected = self.ref.prepare_store(keys, CTX)
        got = self.impl.prepare_store(keys, CTX)
        if expected is None:
            assert got is None
            return
        assert got is not None
        assert got.keys_to_store == expected.keys_to_store
        assert ids(got.store_spec) == ids(expected.store_spec)
        assert got.evicted_keys == expected.evicted_keys

        untouchable = self.writing | set(self.pins) | set(keys)
        assert untouchable.isdisjoint(got.evicted_keys)
        assert len(set(got.evicted_keys)) == len(got.evicted_keys)
        for key in got.evicted_keys:
            assert key in self.held
            del self.held[key]
        self.evicted.update(got.evicted_keys)
        assert not set(got.keys_to_store) & set(self.held)
        self.held.update(zip(got.keys_to_store, ids(got.store_spec), strict=True))
        self.writing.update(got.keys_to_store)

    @rule(keys=key_lists, success=st.booleans())
    def complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        self.ref.complete_store(keys, success)
        self.impl.complete_store(keys, success)
        finished = self.writing.intersection(keys)
        self.writing -= finished
        if not success:
            for key in finished:
                del self.held[key]

    @precondition(lambda self: bool(self.writing))
    @rule(data=st.data(), success=st.booleans())
    def complete_some_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.writing)), min_size=1, max_size=3))
        self.complete_store(keys, success)

    @rule(keys=key_lists)
    def prepare_load(self, keys: list[OffloadKey]) -> None:
        try:
            expected = ids(self.ref.prepare_load(keys, CTX))
        except AiokvoError as ref_error:
            try:
                self.impl.prepare_load(keys, CTX)
            except AiokvoError as error:
                assert type(error) is type(ref_error)
            else:
                raise AssertionError(f"expected {type(ref_error).__name__}") from None
            return
        assert ids(self.impl.prepare_load(keys, CTX)) == expected
        assert expected == [self.held[key] for key in keys]
        if keys:
            self.loads.append(keys)

    @precondition(lambda self: bool(self.ready_now()))
    @rule(data=st.data())
    def prepare_load_ready(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready_now())), max_size=3))
        self.prepare_load(keys)

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        """Release the pins of one earlier load, as a finished transfer would."""
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.ref.complete_load(keys)
        self.impl.complete_load(keys)

    @property
    def pins(self) -> Counter[OffloadKey]:
        return Counter(key for keys in self.loads for key in keys)

    @rule(keys=key_lists)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.ref.touch(keys)
        self.impl.touch(keys)

    @precondition(lambda self: len(self.held) >= 2)
    @rule(data=st.data())
    def touch_held(self, data: st.DataObject) -> None:
        """Reorder live keys (random key lists rarely name two of them)."""
        held = st.sampled_from(sorted(self.held))
        self.touch(data.draw(st.lists(held, min_size=2, max_size=4)))

    @precondition(lambda self: bool(self.evicted))
    @rule(data=st.data())
    def touch_evicted(self, data: st.DataObject) -> None:
        """Hit ARC's ghost lists, which move its target."""
        gone = st.sampled_from(sorted(self.evicted))
        self.touch(data.draw(st.lists(gone, min_size=1, max_size=3)))

    def ready_now(self) -> set[OffloadKey]:
        return set(self.held) - self.writing

    # -- invariants ------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "held"):
            return
        assert len(self.held) <= self.num_blocks
        block_ids = list(self.held.values())
        assert len(set(block_ids)) == len(block_ids)
        assert all(0 <= block_id < self.num_blocks for block_id in block_ids)

    @invariant()
    def blocks_agree_with_the_reference(self) -> None:
        if not hasattr(self, "held"):
            return
        pins = self.pins
        for key in KEYS:
            # The cores are pure on lookup (the reuse wrapper would count it).
            assert self.impl_core.lookup(key, CTX) == self.ref_core.lookup(key, CTX)
            status = self.impl_core.block_status(key)
            if key not in self.held:
                assert status is None
                continue
            assert status is not None
            ref_cnt = -1 if key in self.writing else pins[key]
            assert (status.block_id, status.ref_cnt) == (self.held[key], ref_cnt)
        assert self.ref_core.entries() == {
            key: (block_id, -1 if key in self.writing else pins[key])
            for key, block_id in self.held.items()
        }

    @invariant()
    def events_replay_to_the_ready_keys(self) -> None:
        if not hasattr(self, "held"):
            return
        events = list(self.impl.take_events())
        assert events == list(self.ref.take_events())
        for event in events:
            assert event.medium == "CPU"
            if event.removed:
                assert set(event.keys) <= self.replayed
                self.replayed.difference_update(event.keys)
            else:
                assert self.replayed.isdisjoint(event.keys)
                self.replayed.update(event.keys)
        assert self.replayed == self.ready_now()


class ReuseFilterMachine(ManagerMachine):
    """The same checks with both managers behind the reuse filter."""

    wrap_reuse = True


TestManagerStateful = ManagerMachine.TestCase
TestManagerStateful.settings = SETTINGS
TestReuseFilterStateful = ReuseFilterMachine.TestCase
TestReuseFilterStateful.settings = settings(SETTINGS, max_examples=75)
