"""Each of aiokvo's own policies, driven directly: its own invariants, step by step.

A hypothesis state machine inserts, touches (some keys still being
written), evicts with random exclusions and removes, on a policy alone.
Every step checks the interface (``get``, ``len``, ``items`` and the
victims against a model dict; an ``evict`` that returns None changed no
state at all) and then what makes the policy itself:

* SLRU: the protected segment never exceeds its share; a key used again is
  protected; protected keys are taken only when probation has too few.
* SIEVE: a use sets the visited bit; the first victim was unvisited when
  the call began, unless every candidate was visited.
* S3-FIFO: counts stay within two bits; ghosts are never cached and never
  exceed main's size; a new key that was a ghost enters main; what the
  small queue drops becomes a ghost.
* chain: cold keys are level 0, hot keys 1..3; a stored run goes hot only
  as a prefix (never a hot key after a cold one); a key used again is hot;
  hot keys are taken only when cold has too few; after a touch, the keys of
  one list are evicted tail first.
"""

from __future__ import annotations

import copy
from collections.abc import Container
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.policies import (
    ChainCachePolicy,
    S3FIFOCachePolicy,
    SIEVECachePolicy,
    SLRUCachePolicy,
)
from aiokvo.manager.policies.base import CachePolicy
from aiokvo.manager.policies.chain import MAX_LEVEL

KEYS = [make_offload_key(b"k%d" % n, 0) for n in range(12)]
OWN = {
    "slru": SLRUCachePolicy,
    "sieve": SIEVECachePolicy,
    "s3fifo": S3FIFOCachePolicy,
    "chain": ChainCachePolicy,
}


def state(policy: CachePolicy) -> dict[str, Any]:
    """Everything the policy holds, copied (an all-or-nothing check compares it)."""

    def plain(value: Any) -> Any:
        slots = getattr(type(value), "__slots__", None)
        if slots and not isinstance(value, (bytes, int)):
            return {name: plain(getattr(value, name)) for name in slots}
        return value

    return copy.deepcopy({name: plain(value) for name, value in vars(policy).items()})


class PolicyMachine(RuleBasedStateMachine):
    policy: CachePolicy

    @initialize(name=st.sampled_from(sorted(OWN)), capacity=st.integers(1, 8))
    def build(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.policy = OWN[name](capacity)
        self.model: dict[OffloadKey, int] = {}
        self.free = list(range(capacity))

    # -- rules -----------------------------------------------------------------

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        absent = [key for key in KEYS if key not in self.model]
        room = min(len(absent), len(self.free))
        if not room:
            return
        keys = data.draw(st.lists(st.sampled_from(absent), min_size=1, max_size=room, unique=True))
        block_ids = [self.free.pop() for _ in keys]
        ghosts = set(self.policy.ghosts) if isinstance(self.policy, S3FIFOCachePolicy) else set()
        self.policy.insert(keys, block_ids)
        self.model.update(zip(keys, block_ids, strict=True))
        if isinstance(self.policy, S3FIFOCachePolicy):
            for key in keys:
                assert (key in self.policy.main) == (key in ghosts)
                assert self.policy.uses(key) == 0
        if isinstance(self.policy, ChainCachePolicy):
            levels = [self.policy.level(key) for key in keys]
            assert levels == sorted(levels, reverse=True), "a hot key after a cold one"
            assert set(levels) <= {0, 1}

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6, unique=True), data=st.data())
    def touch(self, keys: list[OffloadKey], data: st.DataObject) -> None:
        writing = set(data.draw(st.lists(st.sampled_from(keys), unique=True))) if keys else set()
        before_uses = {}
        if isinstance(self.policy, S3FIFOCachePolicy):
            before_uses = {key: self.policy.uses(key) for key in keys if key in self.model}
        self.policy.touch(keys, writing)
        used = [key for key in keys if key in self.model and key not in writing]
        if isinstance(self.policy, SLRUCachePolicy):
            assert len(self.policy.protected) <= self.policy.protected_capacity
            # (protected keys touched while being written are moved too, and count)
            if self.policy.protected_capacity >= len([k for k in keys if k in self.model]):
                assert set(used) <= set(self.policy.protected)
        if isinstance(self.policy, SIEVECachePolicy):
            assert all(self.policy.visited(key) for key in used)
        if isinstance(self.policy, S3FIFOCachePolicy):
            for key in used:
                assert self.policy.uses(key) == min(3, before_uses[key] + 1)
        if isinstance(self.policy, ChainCachePolicy):
            assert all(self.policy.level(key) >= 1 for key in used)
            # Tail first: among the touched keys of each list, in eviction order.
            touched = [key for key in keys if key in self.model]
            for order in (self.policy.cold, self.policy.hot):
                mine = [key for key in order if key in touched]
                assert mine == [key for key in reversed(touched) if key in mine]

    @rule(n=st.integers(0, 4), data=st.data())
    def evict(self, n: int, data: st.DataObject) -> None:
        held = sorted(self.model)
        excluded = set(data.draw(st.lists(st.sampled_from(held), unique=True))) if held else set()
        exclude: list[Container[OffloadKey]] = [excluded]
        before = state(self.policy)
        candidates = [key for key in self.model if key not in excluded]
        visited = {}
        if isinstance(self.policy, SIEVECachePolicy):
            visited = {key: self.policy.visited(key) for key in candidates}
        small, ghosts_before = set(), set()
        if isinstance(self.policy, S3FIFOCachePolicy):
            small, ghosts_before = set(self.policy.small), set(self.policy.ghosts)
        cold = list(self.policy.cold) if isinstance(self.policy, ChainCachePolicy) else []
        probation = (
            list(self.policy.probation) if isinstance(self.policy, SLRUCachePolicy) else []
        )
        out = self.policy.evict(n, exclude)
        if out is None:
            assert len(candidates) < n, "refused although enough blocks were evictable"
            assert state(self.policy) == before, "a refused eviction changed the policy"
            return
        victims, block_ids = out
        assert len(victims) == n == len(block_ids)
        assert len(set(victims)) == n
        assert not excluded & set(victims)
        assert block_ids == [self.model[key] for key in victims]
        for key in victims:
            del self.model[key]
        self.free += block_ids
        if isinstance(self.policy, SIEVECachePolicy) and victims and not all(visited.values()):
            assert not visited[victims[0]], "SIEVE evicted a visited block first"
        if isinstance(self.policy, S3FIFOCachePolicy):
            # Only blocks dropped by the small queue become ghosts (one used there
            # moves to main first, and may then leave from main, unremembered).
            ghosts = set(self.policy.ghosts)
            assert ghosts - ghosts_before <= set(victims) & small
            if self.policy.ghost_capacity and victims and victims[-1] in ghosts - ghosts_before:
                assert self.policy.ghosts[-1] == victims[-1]
        if isinstance(self.policy, ChainCachePolicy):
            cold_free = [key for key in cold if key not in excluded]
            assert victims[: len(cold_free)] == cold_free[:n], "hot taken before cold"
        if isinstance(self.policy, SLRUCachePolicy):
            free_probation = [key for key in probation if key not in excluded]
            assert victims[: len(free_probation)] == free_probation[:n]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        self.policy.remove(keys)
        for key in keys:
            self.free.append(self.model.pop(key))

    # -- invariants ------------------------------------------------------------

    @invariant()
    def interface_matches_the_model(self) -> None:
        if not hasattr(self, "model"):
            return
        policy = self.policy
        assert len(policy) == len(self.model)
        assert dict(policy.items()) == self.model
        assert len(list(policy.items())) == len(self.model)
        for key in KEYS:
            assert policy.get(key) == self.model.get(key)
            assert (key in policy) == (key in self.model)
        assert policy.uncached(KEYS) == [key for key in KEYS if key not in self.model]
        held = [key for key in KEYS if key in self.model]
        assert policy.block_ids(held) == [self.model[key] for key in held]

    @invariant()
    def own_invariants(self) -> None:
        if not hasattr(self, "model"):
            return
        policy = self.policy
        if isinstance(policy, S3FIFOCachePolicy):
            assert len(policy.ghosts) <= policy.ghost_capacity
            assert not set(policy.ghosts) & set(self.model)
            assert all(0 <= policy.uses(key) <= 3 for key in self.model)
            assert set(policy.small) | set(policy.main) == set(self.model)
        if isinstance(policy, ChainCachePolicy):
            assert all(policy.level(key) == 0 for key in policy.cold)
            assert all(1 <= policy.level(key) <= MAX_LEVEL for key in policy.hot)
            assert set(policy.cold) | set(policy.hot) == set(self.model)
        if isinstance(policy, SLRUCachePolicy):
            assert len(policy.protected) <= policy.protected_capacity
            assert set(policy.probation) | set(policy.protected) == set(self.model)


TestPolicyInvariants = PolicyMachine.TestCase
TestPolicyInvariants.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
