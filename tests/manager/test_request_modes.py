"""vLLM 0.32's rules as manager modes: request recency, offer counting, ARC, reset.

Hand-worked scenarios first (each states the rule it pins), then long seeded
random traces against ``_request_reference`` (the same decisions, made the
slow and obvious way).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from aiokvo.config import OffloadConfig
from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies.arc import ARCCachePolicy
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.offloading_spec import CPUOffloadingSpec
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, OffloadingEvent, ReqContext
from tests.manager._request_reference import RefARC, RefRequestManager
from tests.manager.test_internals import NaiveLRU


def key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(b"block%d" % n, group)


def keys(*ns: int) -> list[OffloadKey]:
    return [key(n) for n in ns]


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def stored(m: CPUOffloadingManager | FilterReusedOffloadingManager, ks: list[OffloadKey],
           ctx: ReqContext) -> list[OffloadKey]:
    """Offer ``ks``, complete the store; the keys it stored."""
    out = m.prepare_store(ks, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out.keys_to_store


def lru_order(m: CPUOffloadingManager) -> list[OffloadKey]:
    return [k for k, _ in m.policy.items()]


def arc(m: CPUOffloadingManager) -> ARCCachePolicy:
    assert isinstance(m.policy, ARCCachePolicy)
    return m.policy


# ------------------------------------------------------------------ validation


def test_modes_are_validated_and_defaults_are_the_seeds() -> None:
    with pytest.raises(ConfigError, match="recency must be one of 'touch', 'request', got 'later'"):
        CPUOffloadingManager(4, recency="later")  # type: ignore[arg-type]
    base = CPUOffloadingManager(4)
    assert base.recency == "touch" and base.policy.recency == "touch"
    with pytest.raises(ConfigError, match="counting must be one of 'lookups', 'offers'"):
        FilterReusedOffloadingManager(base, counting="stores")  # type: ignore[arg-type]
    assert FilterReusedOffloadingManager(base).counting == "lookups"
    config = dict(gpu_block_sizes=(16,), hash_block_size=16, cpu_bytes_to_use=64,
                  kv_bytes_per_block=8, store_threshold=2)
    with pytest.raises(ConfigError, match="recency"):
        OffloadConfig(**config, recency="soon")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="store_counting"):
        OffloadConfig(**config, store_counting=3)  # type: ignore[arg-type]


def test_the_spec_builds_the_modes_the_config_names() -> None:
    config = OffloadConfig(gpu_block_sizes=(16,), hash_block_size=16, cpu_bytes_to_use=64,
                           kv_bytes_per_block=8, store_threshold=2, recency="request",
                           store_counting="offers", eviction_policy="arc")
    manager = CPUOffloadingSpec(config).get_manager()
    assert isinstance(manager, FilterReusedOffloadingManager) and manager.counting == "offers"
    assert isinstance(manager.backing, CPUOffloadingManager)
    assert manager.backing.recency == "request" and manager.backing.policy.recency == "request"
    parsed = OffloadConfig.from_dict(
        {"cpu_bytes_to_use": 64, "recency": "request", "store_counting": "offers"},
        gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=8,
    )
    assert (parsed.recency, parsed.store_counting) == ("request", "offers")


# ------------------------------------------------------- request recency, LRU


def test_lru_recency_comes_at_finish_head_of_the_prefix_most_recent() -> None:
    m = CPUOffloadingManager(4, recency="request")
    a = ReqContext()
    stored(m, keys(1, 2), a)
    stored(m, keys(3), a)
    assert lru_order(m) == keys(1, 2, 3)  # insertion order until the request ends
    m.on_request_finished(a)
    assert lru_order(m) == keys(3, 2, 1)  # tail first out, head most recent
    b = ReqContext()
    m.prepare_load(keys(3), b)  # a reuse, applied only when b finishes
    m.complete_load(keys(3))
    assert lru_order(m) == keys(3, 2, 1)
    m.on_request_finished(b)
    assert lru_order(m) == keys(2, 1, 3)
    c = ReqContext()
    out = m.prepare_store(keys(4, 5), c)  # one free block: evicts the LRU one
    assert out is not None and out.evicted_keys == keys(2)


def test_touch_mode_ignores_on_request_finished_and_request_mode_still_touches() -> None:
    seed = CPUOffloadingManager(4)
    ctx = ReqContext()
    stored(seed, keys(1, 2, 3), ctx)
    seed.on_request_finished(ctx)
    assert lru_order(seed) == keys(1, 2, 3)
    m = CPUOffloadingManager(4, recency="request")
    stored(m, keys(1, 2, 3), ctx)
    m.touch(keys(1))
    assert lru_order(m) == keys(2, 3, 1)


def test_finish_applies_once_and_a_reused_context_starts_afresh() -> None:
    m = CPUOffloadingManager(4, recency="request")
    ctx = ReqContext()
    stored(m, keys(1, 2), ctx)
    m.on_request_finished(ctx)
    assert lru_order(m) == keys(2, 1)
    m.touch(keys(2))
    m.on_request_finished(ctx)  # nothing recorded since: no change
    assert lru_order(m) == keys(1, 2)
    m.prepare_load(keys(1), ctx)
    m.on_request_finished(ctx)
    assert lru_order(m) == keys(2, 1)


def test_positions_order_the_keys_across_groups() -> None:
    m = CPUOffloadingManager(8, recency="request")
    ctx = ReqContext()
    g0, g1 = [key(n, 0) for n in (1, 2)], [key(n, 1) for n in (1, 2)]
    stored(m, [g0[1], g1[1], g0[0], g1[0]], ctx)  # offered tail first
    where = {g0[0]: 16, g1[0]: 16, g0[1]: 32, g1[1]: 32}
    m.on_request_finished(ctx, where.get)
    # Head to tail by position (group 0 first within one position), applied
    # tail first, so least recent first is the reverse: tail .. head.
    assert lru_order(m) == [g1[1], g0[1], g1[0], g0[0]]
    m2 = CPUOffloadingManager(8, recency="request")
    ctx2 = ReqContext()
    stored(m2, [g0[1], g1[1], g0[0], g1[0]], ctx2)
    m2.on_request_finished(ctx2)  # no positions: group by group, in offer order
    assert lru_order(m2) == [g1[0], g1[1], g0[0], g0[1]]


def test_keys_being_written_are_not_a_use_and_new_keys_only_once_stored() -> None:
    m = CPUOffloadingManager(2, recency="request")
    a, b = ReqContext(), ReqContext()
    out = m.prepare_store(keys(1), a)
    assert out is not None  # 1 is being written
    assert m.prepare_store(keys(1, 2), b) is not None  # b offers 1 (writing) and 2
    m.complete_store(keys(1, 2))
    m.on_request_finished(a)  # a stored 1: insertion only
    m.on_request_finished(b)  # b stored 2 only; 1 was in flight, so not b's use
    assert lru_order(m) == keys(1, 2)


# ---------------------------------------------------------- request recency, ARC


def test_arc_a_requests_own_stores_stay_in_t1_and_a_reuse_promotes_once() -> None:
    m = CPUOffloadingManager(4, "arc", recency="request")
    a = ReqContext()
    stored(m, keys(1, 2), a)
    m.prepare_load(keys(1), a)  # re-reading its own insert is not a second use
    m.complete_load(keys(1))
    m.on_request_finished(a)
    assert list(arc(m).t1) == keys(2, 1) and not arc(m).t2
    b = ReqContext()
    m.prepare_load(keys(1, 2), b)
    m.prepare_load(keys(1), b)  # twice in one request: still one promotion
    m.complete_load(keys(1, 2, 1))
    assert not arc(m).t2  # promotion waits for the finish
    m.on_request_finished(b)
    assert list(arc(m).t2) == keys(2, 1) and not arc(m).t1
    c = ReqContext()
    assert stored(m, keys(1, 3), c) == keys(3)  # 1 is ready: a reuse by offer
    m.on_request_finished(c)
    assert list(arc(m).t1) == keys(3) and list(arc(m).t2) == keys(2, 1)


def test_arc_ghost_hits_adapt_once_per_request_even_when_the_store_fails() -> None:
    m = CPUOffloadingManager(2, "arc", recency="request")
    ctx = ReqContext()
    stored(m, keys(1, 2), ctx)
    stored(m, keys(3, 4), ctx)  # evicts 1, 2 into B1
    assert list(arc(m).b1) == keys(1, 2)
    pin = ReqContext()
    m.prepare_load(keys(3, 4), pin)  # nothing evictable now
    d = ReqContext()
    assert m.prepare_store(keys(1), d) is None
    assert arc(m).target_t1_size == 1.0  # B1 hit, recorded although nothing fits
    assert m.prepare_store(keys(1), d) is None
    assert arc(m).target_t1_size == 1.0  # the same request: not again
    assert m.prepare_store(keys(1), ReqContext()) is None
    assert arc(m).target_t1_size == 2.0  # another request: again


def test_arc_evicts_t1_past_its_target_when_t2_runs_dry_only_with_request_recency() -> None:
    def fill(recency: str) -> CPUOffloadingManager:
        m = CPUOffloadingManager(3, "arc", recency=recency)  # type: ignore[arg-type]
        ctx = ReqContext()
        stored(m, keys(1, 2, 3), ctx)
        m.touch(keys(3))  # 3 -> T2 (the touch rule), then pin it
        m.prepare_load(keys(3), ctx)
        arc(m).target_t1_size = 2.0
        return m

    seed = fill("touch")
    assert seed.prepare_store(keys(4, 5), ReqContext()) is None  # 1 from T1, T2 has none
    m = fill("request")
    out = m.prepare_store(keys(4, 5), ReqContext())
    assert out is not None and out.evicted_keys == keys(1, 2)
    assert list(arc(m).b1) == keys(1, 2)


# --------------------------------------------------------------- offer counting


def test_offers_warm_a_cold_prefix_and_lookups_do_not_count() -> None:
    m = FilterReusedOffloadingManager(
        CPUOffloadingManager(8, recency="request"), store_threshold=2, counting="offers"
    )

    def skipped() -> int:
        return m.statistics().reuse_filtered_blocks

    ctx = ReqContext()
    for k in keys(1, 2):
        assert m.lookup(k, ctx) is False
    assert m.lookup_prefix(keys(1, 2), ctx) == 0
    assert m.counts == {}
    out = m.prepare_store(keys(1, 2), ctx)
    assert out is not None and out.keys_to_store == [] and skipped() == 2
    out = m.prepare_store(keys(1, 2, 3), ctx)  # counted first, so 1 and 2 pass now
    assert out is not None and out.keys_to_store == keys(1, 2) and skipped() == 3
    m.complete_store(out.keys_to_store)
    out = m.prepare_store(keys(1, 2), ReqContext())  # held keys always pass
    assert out is not None and out.keys_to_store == [] and skipped() == 3


def test_a_full_tracker_never_forgets_a_key_of_the_current_offer() -> None:
    m = FilterReusedOffloadingManager(CPUOffloadingManager(8), 2, 2, counting="offers")
    ctx = ReqContext()
    m.prepare_store(keys(1, 2), ctx)
    m.prepare_store(keys(2, 1, 3), ctx)  # full: 3 cannot displace 1 or 2
    assert dict(m.counts) == {key(2): 2, key(1): 2}
    m.prepare_store(keys(3), ctx)  # 3 displaces the LRU entry, 2
    assert dict(m.counts) == {key(1): 2, key(3): 1}


def test_lookup_counting_is_still_the_default() -> None:
    m = FilterReusedOffloadingManager(CPUOffloadingManager(8), store_threshold=2)
    ctx = ReqContext()
    m.lookup(key(1), ctx)
    m.lookup(key(1), ctx)
    out = m.prepare_store(keys(1, 2), ctx)
    assert out is not None and out.keys_to_store == keys(1)


# ------------------------------------------------------------------- reset_cache


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_reset_drops_everything_and_ids_start_again(policy: str) -> None:
    m = CPUOffloadingManager(3, policy, enable_events=True, recency="request")
    a = ReqContext()
    stored(m, keys(1, 2), a)
    m.prepare_load(keys(1), a)
    out = m.prepare_store(keys(3), a)
    assert out is not None
    m.take_events()
    m.reset_cache()
    assert len(m) == 0 and m.num_free_blocks == 3
    assert m.lookup(key(1), a) is False and m.block_status(key(3)) is None
    # Only the ready keys were ever announced, so only they are announced gone.
    assert m.take_events() == [OffloadingEvent(keys(1, 2), "CPU", True)]
    m.on_request_finished(a)  # recorded before the reset: ignored
    out = m.prepare_store(keys(7, 8), ReqContext())
    assert out is not None and ids(out.store_spec) == [0, 1]
    if policy == "arc":
        assert not arc(m).b1 and not arc(m).b2 and arc(m).target_t1_size == 0.0
    m.reset_cache(announce=False)
    assert m.take_events() == []


def test_reset_through_the_filter_keeps_the_counts() -> None:
    m = FilterReusedOffloadingManager(CPUOffloadingManager(4), 2, counting="offers")
    ctx = ReqContext()
    m.prepare_store(keys(1), ctx)
    m.reset_cache()
    out = m.prepare_store(keys(1), ctx)
    assert out is not None and out.keys_to_store == keys(1)


def test_reset_is_refused_by_a_manager_that_does_not_know_it() -> None:
    from aiokvo.manager.base import OffloadingManager

    class Minimal(OffloadingManager):
        def lookup(self, key, req_context):  # type: ignore[no-untyped-def]
            return False

        def prepare_load(self, keys, req_context):  # type: ignore[no-untyped-def]
            raise AssertionError

        def prepare_store(self, keys, req_context):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(NotImplementedError, match="Minimal does not support reset_cache"):
        Minimal().reset_cache()


# --------------------------------------------------------- differential traces


class Trace:
    """One aiokvo manager (0.32 modes) and the reference, driven by one random trace."""

    def __init__(self, policy: str, num_blocks: int, seed: int, threshold: int) -> None:
        self.rng = random.Random(seed)
        # "naive": an out-of-tree policy that relies on CachePolicy's defaults.
        impl_policy: str | type[NaiveLRU] = NaiveLRU if policy == "naive" else policy
        policy = "lru" if policy == "naive" else policy
        self.policy = policy
        core = CPUOffloadingManager(num_blocks, impl_policy, enable_events=True, recency="request")
        self.core = core
        self.impl: CPUOffloadingManager | FilterReusedOffloadingManager = core
        tracker = 16 if seed % 2 else 3  # 3: offers often fill the whole tracker
        if threshold >= 2:
            self.impl = FilterReusedOffloadingManager(core, threshold, tracker, counting="offers")
        self.ref = RefRequestManager(num_blocks, policy, store_threshold=threshold,
                                     max_tracker_size=tracker)
        self.docs = [[key(100 * d + i, g) for i in range(8) for g in (0, 1)] for d in range(6)]
        self.requests: list[tuple[ReqContext, list[OffloadKey], dict[OffloadKey, int], int]] = []
        self.stores: list[list[OffloadKey]] = []
        self.loads: list[list[OffloadKey]] = []

    def new_request(self) -> None:
        doc = self.rng.choice(self.docs)
        n = self.rng.randrange(2, len(doc) + 1)
        ks = doc[:n]
        positions = {k: 16 * (i // 2 + 1) for i, k in enumerate(ks)}
        if self.rng.random() < 0.3:
            positions = {}
        self.requests.append((ReqContext(), ks, positions, 0))

    def step(self, i: int) -> None:
        rng = self.rng
        op = rng.choices(
            ["new", "load", "store", "complete_store", "complete_load", "finish", "reset"],
            [3, 3, 6, 4, 4, 2, 0.15],
        )[0]
        if op == "new" or not self.requests:
            self.new_request()
        elif op == "load":
            ctx, ks, pos, cursor = rng.choice(self.requests)
            run = []
            for k in ks:
                found = self.impl.lookup(k, ctx)
                assert found == self.ref.lookup(k), (i, "lookup")
                if found is not True:
                    break
                run.append(k)
            if run:
                run = run[: rng.randrange(1, len(run) + 1)]
                got = ids(self.impl.prepare_load(run, ctx))
                assert got == self.ref.prepare_load(run, ctx), (i, "prepare_load")
                self.loads.append(run)
        elif op == "store":
            r = rng.randrange(len(self.requests))
            ctx, ks, pos, cursor = self.requests[r]
            if cursor >= len(ks):
                return
            n = rng.randrange(1, 5)
            offer = ks[cursor:cursor + n]
            out = self.impl.prepare_store(offer, ctx)
            want = self.ref.prepare_store(offer, ctx)
            got = None if out is None else (out.keys_to_store, ids(out.store_spec),
                                            out.evicted_keys)
            assert got == want, (i, "prepare_store", offer)
            if out is not None:
                self.requests[r] = (ctx, ks, pos, cursor + len(offer))
                if out.keys_to_store:
                    self.stores.append(out.keys_to_store)
        elif op == "complete_store" and self.stores:
            done = self.stores.pop(rng.randrange(len(self.stores)))
            ok = rng.random() < 0.9
            self.impl.complete_store(done, ok)
            self.ref.complete_store(done, ok)
        elif op == "complete_load" and self.loads:
            done = self.loads.pop(rng.randrange(len(self.loads)))
            self.impl.complete_load(done)
            self.ref.complete_load(done)
        elif op == "finish":
            ctx, ks, pos, _ = self.requests.pop(rng.randrange(len(self.requests)))
            where: Callable[[OffloadKey], int | None] | None = pos.get if pos else None
            self.impl.on_request_finished(ctx, where)
            self.ref.on_request_finished(ctx, where)
        elif op == "reset":
            # The caller's side of the contract: nothing prepared before is completed.
            self.impl.reset_cache(announce=False)
            self.ref.reset_cache()
            self.stores.clear()
            self.loads.clear()
        self.check(i)

    def check(self, i: int) -> None:
        core = self.core
        mine = {k: (b, s.ref_cnt) for k, b in core.policy.items()
                if (s := core.block_status(k)) is not None}
        assert list(mine.items()) == list(self.ref.entries().items()), (i, "state")
        assert core.take_events() == self.ref.events, (i, "events")
        self.ref.events = []
        if isinstance(self.impl, FilterReusedOffloadingManager):
            assert self.impl.statistics().reuse_filtered_blocks == self.ref.skipped, (i, "skipped")
            assert dict(self.impl.counts) == dict(self.ref.counts), (i, "counts")
        if self.policy == "arc":
            mine_arc, ref_arc = arc(core), self.ref.policy
            assert isinstance(ref_arc, RefARC)
            assert list(mine_arc.b1) == list(ref_arc.b1), (i, "b1")
            assert list(mine_arc.b2) == list(ref_arc.b2), (i, "b2")
            assert mine_arc.target_t1_size == ref_arc.target, (i, "target")


@pytest.mark.parametrize("policy", ["lru", "arc", "naive"])
@pytest.mark.parametrize("threshold", [0, 2])
@pytest.mark.parametrize("seed", range(4))
def test_random_traces_match_the_reference(policy: str, threshold: int, seed: int) -> None:
    trace = Trace(policy, num_blocks=10, seed=seed, threshold=threshold)
    for i in range(1500):
        trace.step(i)
