"""The manager's contract under every registered policy, without a reference policy.

``test_stateful.py`` checks LRU and ARC against the seed's algorithms step
by step. A policy of aiokvo's own has no seed reference, so this machine
checks everything that does not depend on *which* blocks a policy chooses,
from a model of the pool built from the manager's own outputs: every
lookup, prefix lookup, load (ids and errors), block status and event is
exactly what the model predicts; block ids are handed out fresh first,
then last freed first; victims are held, idle, not named by the call, and
exactly the shortfall; and ``prepare_store`` refuses only when too few
blocks are evictable (ARC, as the seed, may also refuse when T2 runs dry,
but then changes nothing). Every policy in the registry runs it, LRU and
ARC included.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiokvo.errors import BlockNotReadyError, UnknownKeyError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies import BUILTIN_POLICIES
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, OffloadingEvent, ReqContext

CTX = ReqContext()
KEYS = [make_offload_key(b"blk%d" % n, n % 2) for n in range(8)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=4)
POLICIES = sorted(BUILTIN_POLICIES)


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


class ContractMachine(RuleBasedStateMachine):
    """A manager under one policy, and the pool its outputs imply."""

    manager: CPUOffloadingManager

    @initialize(num_blocks=st.integers(1, 5), policy=st.sampled_from(POLICIES))
    def build(self, num_blocks: int, policy: str) -> None:
        self.policy = policy
        self.num_blocks = num_blocks
        self.manager = CPUOffloadingManager(num_blocks, cache_policy=policy, enable_events=True)
        self.held: dict[OffloadKey, int] = {}
        self.writing: set[OffloadKey] = set()
        self.loads: list[list[OffloadKey]] = []
        self.allocated = 0
        self.free_ids: list[int] = []
        self.events: list[OffloadingEvent] = []

    # -- the model -------------------------------------------------------------

    @property
    def pins(self) -> Counter[OffloadKey]:
        return Counter(key for keys in self.loads for key in keys)

    def ready(self) -> set[OffloadKey]:
        return set(self.held) - self.writing

    def allocate(self, count: int) -> list[int]:
        fresh = min(count, self.num_blocks - self.allocated)
        out = list(range(self.allocated, self.allocated + fresh))
        self.allocated += fresh
        reused = count - fresh
        if reused:
            tail = self.free_ids[-reused:]
            del self.free_ids[-reused:]
            out += reversed(tail)
        return out

    # -- rules -----------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: OffloadKey) -> None:
        expected = None if key in self.writing else key in self.held
        assert self.manager.lookup(key, CTX) is expected

    @rule(keys=key_lists)
    def lookup_prefix(self, keys: list[OffloadKey]) -> None:
        expected: int | None = 0
        for key in keys:
            if key in self.writing:
                expected = None
                break
            if key not in self.held:
                break
            assert expected is not None
            expected += 1
        assert self.manager.lookup_prefix(keys, CTX) == expected

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        new = [key for key in dict.fromkeys(keys) if key not in self.held]
        free = len(self.free_ids) + self.num_blocks - self.allocated
        shortfall = len(new) - free
        idle = set(self.held) - self.writing - set(self.pins) - set(keys)
        before = dict(self.held)
        out = self.manager.prepare_store(keys, CTX)
        if out is None:
            assert new, "nothing new to store is never refused"
            assert shortfall > 0
            if self.policy != "arc":
                assert len(idle) < shortfall, f"{self.policy} refused with enough idle blocks"
            assert {key: self.manager.block_status(key) is not None for key in KEYS} == {
                key: key in before for key in KEYS
            }
            return
        assert out.keys_to_store == new
        evicted = out.evicted_keys
        assert len(evicted) == max(0, shortfall)
        assert len(set(evicted)) == len(evicted)
        assert set(evicted) <= idle, "a victim was in use, being written or named by the call"
        self.free_ids += [self.held.pop(key) for key in evicted]
        if evicted:
            self.events.append(OffloadingEvent(list(evicted), "CPU", True))
        assert ids(out.store_spec) == self.allocate(len(new))
        self.held.update(zip(new, ids(out.store_spec), strict=True))
        self.writing.update(new)

    @rule(keys=key_lists, success=st.booleans())
    def complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        done = [key for key in dict.fromkeys(keys) if key in self.writing]
        self.manager.complete_store(keys, success)
        self.writing.difference_update(done)
        if not done:
            return
        if success:
            self.events.append(OffloadingEvent(done, "CPU", False))
        else:
            self.free_ids += [self.held.pop(key) for key in done]

    @precondition(lambda self: bool(self.writing))
    @rule(data=st.data(), success=st.booleans())
    def complete_some_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.writing)), min_size=1, max_size=3))
        self.complete_store(keys, success)

    @rule(keys=key_lists)
    def prepare_load(self, keys: list[OffloadKey]) -> None:
        missing = [key for key in keys if key not in self.held]
        unready = [key for key in keys if key in self.writing]
        if missing or unready:
            error = UnknownKeyError if missing else BlockNotReadyError
            if missing and unready and keys.index(unready[0]) < keys.index(missing[0]):
                error = BlockNotReadyError
            with pytest.raises(error):
                self.manager.prepare_load(keys, CTX)
            return
        assert ids(self.manager.prepare_load(keys, CTX)) == [self.held[key] for key in keys]
        if keys:
            self.loads.append(keys)

    @precondition(lambda self: bool(self.ready()))
    @rule(data=st.data())
    def prepare_load_ready(self, data: st.DataObject) -> None:
        self.prepare_load(data.draw(st.lists(st.sampled_from(sorted(self.ready())), max_size=3)))

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.manager.complete_load(keys)

    @rule(keys=key_lists)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.manager.touch(keys)

    @precondition(lambda self: len(self.held) >= 2)
    @rule(data=st.data())
    def touch_held(self, data: st.DataObject) -> None:
        self.touch(data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=4)))

    # -- invariants ------------------------------------------------------------

    @invariant()
    def pool_matches_the_model(self) -> None:
        if not hasattr(self, "held"):
            return
        assert len(self.held) <= self.num_blocks
        assert len(set(self.held.values())) == len(self.held)
        assert len(self.manager) == len(self.held)
        assert self.manager.num_free_blocks == (
            len(self.free_ids) + self.num_blocks - self.allocated
        )
        pins = self.pins
        for key in KEYS:
            status = self.manager.block_status(key)
            if key not in self.held:
                assert status is None
                continue
            assert status is not None
            expected = -1 if key in self.writing else pins[key]
            assert (status.block_id, status.ref_cnt) == (self.held[key], expected)
        assert dict(self.manager.policy.items()) == self.held

    @invariant()
    def events_are_the_models(self) -> None:
        if not hasattr(self, "held"):
            return
        assert list(self.manager.take_events()) == self.events
        self.events.clear()


TestPolicyContract = ContractMachine.TestCase
TestPolicyContract.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
