"""Long seeded random traces: the manager must match the seed reference exactly.

Each trace mixes every manager call with weights that keep a small pool
under constant eviction pressure: stores, completions (some failing), loads
(a few invalid), releases, lookups and touches that favour live keys and
recently evicted ones (ARC's ghost hits). After every call the outputs,
the recorded events and every key's block id and reference count must
equal the reference's. Traces are seeded, so a failure names a replayable
(policy, num_blocks, seed, step).
"""

from __future__ import annotations

import random

import pytest

from aiokvo.errors import AiokvoError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, PrepareStoreOutput, ReqContext
from tests.manager._seed_reference import RefCPUManager, RefFilterReused

CTX = ReqContext()
STEPS = 2000
OPS = ["store", "complete", "complete_any", "load", "unload", "touch", "lookup", "prefix"]
WEIGHTS = [6, 4, 1, 3, 5, 5, 2, 1]


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def summary(out: PrepareStoreOutput | None) -> object:
    if out is None:
        return None
    return out.keys_to_store, ids(out.store_spec), out.evicted_keys


class Trace:
    """Drives one manager and one reference with the same random calls."""

    def __init__(self, policy: str, num_blocks: int, seed: int, reuse: tuple[int, int] | None):
        self.rng = random.Random(seed)
        self.keys = [make_offload_key(b"key%d" % n, 0) for n in range(2 * num_blocks + 3)]
        self.core = CPUOffloadingManager(num_blocks, cache_policy=policy, enable_events=True)
        self.ref_core = RefCPUManager(num_blocks, cache_policy=policy, enable_events=True)
        self.impl: OffloadingManager = self.core
        self.ref: OffloadingManager = self.ref_core
        if reuse is not None:
            self.impl = FilterReusedOffloadingManager(self.core, *reuse)
            self.ref = RefFilterReused(self.ref_core, *reuse)
        self.writing: list[OffloadKey] = []
        self.loads: list[list[OffloadKey]] = []
        self.gone: list[OffloadKey] = []

    def some(self, pool: list[OffloadKey], most: int) -> list[OffloadKey]:
        return [self.rng.choice(pool) for _ in range(self.rng.randint(1, most))]

    def step(self, op: str) -> tuple[object, object]:
        """Run ``op`` on both sides; return (impl result, reference result)."""
        rng, keys = self.rng, self.keys
        if op == "store":
            args = self.some(keys, 3)
            got, want = self.impl.prepare_store(args, CTX), self.ref.prepare_store(args, CTX)
            if want is not None:
                self.writing += want.keys_to_store
                self.gone = (self.gone + want.evicted_keys)[-8:]
            return summary(got), summary(want)
        if op in ("complete", "complete_any"):
            if op == "complete" and self.writing:
                args = rng.sample(self.writing, rng.randint(1, len(self.writing)))
            else:
                args = self.some(keys, 3)
            success = rng.random() < 0.85
            self.impl.complete_store(args, success)
            self.ref.complete_store(args, success)
            self.writing = [key for key in self.writing if key not in args]
            return None, None
        if op == "load":
            ready = sorted(self.ref_core.ready_keys())
            args = self.some(ready, 3) if ready else []
            if rng.random() < 0.1:
                args.insert(rng.randrange(len(args) + 1), rng.choice(keys))
            return self.outcome(self.impl, args), self.outcome(self.ref, args)
        if op == "unload":
            if not self.loads:
                return None, None
            args = self.loads.pop(rng.randrange(len(self.loads)))
            self.impl.complete_load(args)
            self.ref.complete_load(args)
            return None, None
        if op == "touch":
            pool = [*self.ref_core.entries(), *self.gone, *self.gone] or keys
            args = self.some(pool, 4)
            self.impl.touch(args)
            self.ref.touch(args)
            return None, None
        if op == "lookup":
            key = rng.choice(keys)
            return self.impl.lookup(key, CTX), self.ref.lookup(key, CTX)
        assert op == "prefix"
        args = self.some(keys, 4)
        return self.impl.lookup_prefix(args, CTX), self.ref.lookup_prefix(args, CTX)

    def outcome(self, manager: OffloadingManager, args: list[OffloadKey]) -> object:
        try:
            block_ids = ids(manager.prepare_load(args, CTX))
        except AiokvoError as error:
            return type(error).__name__
        if manager is self.ref:
            self.loads.append(args)
        return block_ids

    def state(self, manager: CPUOffloadingManager | RefCPUManager) -> object:
        statuses = (manager.block_status(key) for key in self.keys)
        return [None if s is None else (s.block_id, s.ref_cnt) for s in statuses]


def run(policy: str, num_blocks: int, seed: int, reuse: tuple[int, int] | None = None) -> None:
    trace = Trace(policy, num_blocks, seed, reuse)
    for step in range(STEPS):
        op = trace.rng.choices(OPS, WEIGHTS)[0]
        got, want = trace.step(op)
        where = f"{policy=} {num_blocks=} {seed=} {reuse=} {step=} {op=}"
        assert got == want, where
        assert list(trace.impl.take_events()) == list(trace.ref.take_events()), where
        assert trace.state(trace.core) == trace.state(trace.ref_core), where


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_blocks", [1, 2, 3, 4, 6, 9, 16])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_matches_reference(policy: str, num_blocks: int, seed: int) -> None:
    run(policy, num_blocks, seed)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("num_blocks", "threshold", "tracker"), [(2, 2, 3), (4, 3, 8)])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_reuse_filter_matches_reference(
    policy: str, num_blocks: int, threshold: int, tracker: int, seed: int
) -> None:
    run(policy, num_blocks, seed, reuse=(threshold, tracker))
