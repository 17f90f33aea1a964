"""The disk tier's pure core (a SlotIndex under a TierCore) against a model, over random
call sequences.

A hypothesis state machine drives ``offer``/``prepare_write``/``complete_write``
(each block committed or failed at random), ``lookup``/``prepare_read``/
``complete_read`` (each block good, corrupt, missing or failed at random),
foreign blocks appearing and disappearing, and the clock, on a small tier
(4 slots, 7 keys) so eviction happens all the time. After every step it
checks, from the outputs alone: slots never overflow and are unique and in
range; only committed blocks are readable; a block being written or read is
never evicted or removed; a corrupt block is never reported good and is gone
afterwards unless another read holds it; every read reports exactly its
good blocks; the core counts every block written, read and failed; and replaying
the DISK events gives exactly the committed set.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.sink import EventSink
from aiokvo.tiers.base import TierLoad, TierStore
from aiokvo.tiers.core import TierCore
from aiokvo.tiers.disk.spec import DiskLoadStoreSpec
from aiokvo.tiers.outcome import Outcome
from aiokvo.tiers.settings import TierSettings
from aiokvo.tiers.slot_index import AdoptedEntry, Adoption, BlockLocation, SlotIndex

KEYS = [make_offload_key(b"disk%d" % n, 0) for n in range(7)]
SLOTS = 4
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)
read_outcomes = st.sampled_from(
    [Outcome.OK, Outcome.OK, Outcome.CORRUPT, Outcome.MISSING, Outcome.IO_ERROR,
     Outcome.NOT_RUN]
)  # fmt: skip
write_outcomes = st.sampled_from([Outcome.OK, Outcome.OK, Outcome.IO_ERROR])


class DiskStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sink = EventSink(record=True)
        self.index = SlotIndex(SLOTS, medium="DISK", slab=0, sink=self.sink)
        self.state = TierCore(
            self.index,
            TierSettings(model_id="m", failure_threshold=10**9),
            spec_class=DiskLoadStoreSpec,
        )
        adopted = (AdoptedEntry(1, KEYS[0], 11, 5), AdoptedEntry(3, KEYS[1], 12, 7))
        assert self.index.adopt(Adoption(0, adopted)) == []
        self.committed: set[OffloadKey] = {KEYS[0], KEYS[1]}
        self.writing: set[OffloadKey] = set()
        self.reading: Counter[OffloadKey] = Counter()
        self.foreign: dict[OffloadKey, BlockLocation] = {}
        self.writes: list[TierStore] = []
        self.reads: list[TierLoad] = []
        self.replayed: set[OffloadKey] = set()
        self.counted: Counter[str] = Counter()
        self.now = 0.0

    # ------------------------------------------------------------ writes
    @rule(ks=key_lists)
    def write(self, ks: list[OffloadKey]) -> None:
        wanted = self.state.offer(ks, self.now)
        assert set(wanted) == {k for k in ks if k not in self.committed | self.writing
                               and k not in self.foreign}  # fmt: skip
        store = self.state.prepare_write(wanted, self.now)
        if store is None:
            idle = self.committed - set(self.reading) - self.writing
            free = SLOTS - len(self.committed) - len(self.writing)
            assert not wanted or len(set(wanted)) > free + len(idle)
            return
        assert store.keys == list(dict.fromkeys(wanted))
        for gone in store.evicted:
            assert gone in self.committed, "only committed blocks are evicted"
            assert gone not in self.reading and gone not in store.keys
            self.committed.discard(gone)
        self.writing.update(store.keys)
        self.writes.append(store)

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def finish_write(self, data: st.DataObject) -> None:
        store = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        spec = store.spec
        assert isinstance(spec, DiskLoadStoreSpec)
        for i in range(len(spec.keys)):
            spec.outcomes.status[i] = data.draw(write_outcomes)
            spec.outcomes.checksums[i] = 1000 + i
        done = self.state.complete_write(store, error=None, now=self.now)
        ok = [k for k, s in zip(spec.keys, spec.outcomes.status, strict=True) if s is Outcome.OK]
        assert done == ok
        self.counted["blocks_written"] += len(ok)
        self.counted["write_failures"] += len(spec.keys) - len(ok)
        self.writing.difference_update(spec.keys)
        self.committed.update(ok)

    # ------------------------------------------------------------- reads
    @rule(ks=key_lists)
    def read(self, ks: list[OffloadKey]) -> None:
        n = self.state.lookup(ks, self.now)
        expected = 0
        for k in ks:
            if k not in self.committed and k not in self.foreign:
                break
            expected += 1
        assert n == expected
        if not n:
            return
        load = self.state.prepare_read(ks[:n], self.now)
        assert load is not None and load.keys == ks[:n]
        spec = load.spec
        assert isinstance(spec, DiskLoadStoreSpec)
        for k, where in zip(spec.keys, spec.where, strict=True):
            if where.slab == 0:
                assert k in self.committed
                self.reading[k] += 1
            else:
                assert self.foreign[k] == where
        self.reads.append(load)

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def finish_read(self, data: st.DataObject) -> None:
        load = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        spec = load.spec
        assert isinstance(spec, DiskLoadStoreSpec)
        for i in range(len(spec.keys)):
            spec.outcomes.status[i] = data.draw(read_outcomes)
        good = self.state.complete_read(load, error=None, now=self.now)
        statuses = spec.outcomes.status
        assert good == [k for k, s in zip(spec.keys, statuses, strict=True) if s is Outcome.OK]
        self.counted["blocks_read"] += len(good)
        self.counted["read_failures"] += len(spec.keys) - len(good)
        self.counted["checksum_failures"] += statuses.count(Outcome.CORRUPT)
        own = [k for k, w in zip(spec.keys, spec.where, strict=True) if w.slab == 0]
        self.reading.subtract(own)
        self.reading += Counter()  # drop zeros
        for k, where, status in zip(spec.keys, spec.where, statuses, strict=True):
            if status not in (Outcome.CORRUPT, Outcome.MISSING):
                continue
            if where.slab == 0:
                if not self.reading[k]:
                    self.committed.discard(k)  # removed: no other read holds it
            elif self.foreign.get(k) == where:
                del self.foreign[k]

    # ------------------------------------------------- other processes
    @rule(k=st.sampled_from(KEYS), slot=st.integers(0, 7))
    def foreign_block(self, k: OffloadKey, slot: int) -> None:
        self.foreign[k] = BlockLocation(1, slot, 99, 3)
        self.index.set_foreign(self.foreign)

    @rule()
    def foreign_gone(self) -> None:
        self.foreign.clear()
        self.index.set_foreign({})

    # ---------------------------------------------------------- checks
    @invariant()
    def slots_are_bounded_and_unique(self) -> None:
        slots = self.index.slots
        held = [slots.slot_of(k) for k in KEYS if slots.slot_of(k) is not None]
        assert len(held) == len(set(held)) <= SLOTS
        assert all(0 <= s < SLOTS for s in held if s is not None)
        assert len(held) == len(self.committed) + len(self.writing)

    @invariant()
    def the_core_counts_every_block(self) -> None:
        for name in ("blocks_written", "write_failures", "blocks_read", "read_failures",
                     "checksum_failures"):  # fmt: skip
            assert getattr(self.state, name) == self.counted[name], name

    @invariant()
    def only_committed_blocks_are_readable(self) -> None:
        for k in KEYS:
            assert self.index.holds(k) == (k in self.committed or k in self.foreign)

    @invariant()
    def events_replay_to_the_committed_set(self) -> None:
        for event in self.sink.take():
            assert event.medium == "DISK"
            if event.removed:
                self.replayed.difference_update(event.keys)
            else:
                self.replayed.update(event.keys)
        assert self.replayed == self.committed


DiskStateMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDiskState = DiskStateMachine.TestCase
