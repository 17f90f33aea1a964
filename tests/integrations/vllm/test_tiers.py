"""aiokvo's disk tier behind vLLM's connector (``aiokvo_tiers``), in vLLM's real engine loop.

The harness (``harness.py``) runs vLLM's scheduler and both connector roles
over a fake model whose KV is a function of the token prefix, and checks
every load byte for byte. Here the CPU pool is dropped between phases, so
what comes back must come from the disk tier: a lookup that misses the pool
answers pending, the manager promotes from disk at the end of the step, and
the next lookup hits.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvo.errors import ConfigError
from aiokvo.integrations.vllm import AiokvoOffloadingManager
from aiokvo.integrations.vllm.extra_config import check_extra_config
from aiokvo.integrations.vllm.metrics import metric_definitions
from tests.integrations.vllm.harness import AIOKVO_SPEC, BLOCK, VOCAB, Harness

pytestmark = pytest.mark.system  # vLLM's real engine loop, a real filesystem

TIER_READ = "vllm:kv_offload_aiokvo_tier_blocks_read"
TIER_WRITTEN = "vllm:kv_offload_aiokvo_tier_blocks_written"


def disk(root: Path) -> dict[str, Any]:
    return {"aiokvo_tiers": [{"kind": "disk", "root": str(root), "capacity_bytes": 64 << 20,
                              "fsync": "none"}]}


def settle(h: Harness, deadline: float = 60.0) -> None:
    """Step the manager until its tier transfers have ended (the engine is idle)."""
    manager = h.manager
    assert isinstance(manager, AiokvoOffloadingManager)
    tiers = manager.tiers
    assert tiers is not None
    end = time.monotonic() + deadline
    while tiers.has_pending_work():
        assert time.monotonic() < end, "tier transfers did not end"
        tiers.step()
        time.sleep(0.005)


def record_events(h: Harness) -> collections.Counter[tuple[str, str | None, bool]]:
    """Count the events vLLM's scheduler takes, by (medium, ownership, removed)."""
    seen: collections.Counter[tuple[str, str | None, bool]] = collections.Counter()
    take = h.manager.take_events

    def taking() -> list[Any]:
        out = list(take())
        for e in out:
            seen[(e.medium.name, getattr(e, "ownership", None), e.removed)] += len(e.keys)
        return out

    h.manager.take_events = taking
    return seen


def docs(n: int = 3, blocks: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(x) for x in rng.integers(10, VOCAB, size=blocks * BLOCK)] for _ in range(n)]


def question(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(10, VOCAB, size=11)]


def test_stores_reach_the_disk_and_come_back_after_the_pool_is_dropped(
    harness_factory: Any, tmp_path: Path
) -> None:
    h = harness_factory(spec=dict(AIOKVO_SPEC), extra=disk(tmp_path))
    events = record_events(h)
    prefixes = docs()
    for i, d in enumerate(prefixes):
        h.add(d + question(i))
    h.run_until_idle()
    settle(h)
    tier = h.manager.tiers.tiers[0]
    written = tier.statistics().blocks_written
    assert written >= len(prefixes) * 5
    # Drop the GPU prefix cache and the CPU pool: only the disk has the prefixes now.
    assert h.sched.reset_prefix_cache(reset_connector=True)
    before = h.loads_checked
    pending = h.lookup_results["HIT_PENDING"]
    for i, d in enumerate(prefixes):
        h.add(d + question(10 + i))
    h.run_until_idle()
    assert h.lookup_results["HIT_PENDING"] > pending  # deferred, not blocked
    assert h.loads_checked - before == len(prefixes)  # every prefix loaded, checked
    assert not h.pending_load_checks
    stats = tier.statistics()
    assert stats.blocks_read >= len(prefixes) * 5
    assert (stats.read_failures, stats.checksum_failures) == (0, 0)
    own = h.manager.tiers.statistics()
    assert own.promoted_blocks == stats.blocks_read and own.promotion_failures == 0
    assert h.stats_counters[TIER_READ] == stats.blocks_read
    assert h.stats_counters[TIER_WRITTEN] >= written
    assert h.check_cpu_pool() > 0  # promoted blocks hold their keys' KV
    # The disk's stores reach vLLM's event publisher as STORAGE events, owned "disk".
    disk_stored = sum(n for (medium, owner, removed), n in events.items()
                      if (medium, owner, removed) == ("STORAGE", "disk", False))
    assert disk_stored == written
    assert events[("CPU", None, False)] > 0


def test_a_second_engine_on_the_same_root_loads_from_disk(
    harness_factory: Any, tmp_path: Path
) -> None:
    prefixes = docs(2)
    one = harness_factory(spec=dict(AIOKVO_SPEC), extra=disk(tmp_path))
    for i, d in enumerate(prefixes):
        one.add(d + question(i))
    one.run_until_idle()
    settle(one)
    one.close()
    two = harness_factory(spec=dict(AIOKVO_SPEC), extra=disk(tmp_path))
    for i, d in enumerate(prefixes):
        two.add(d + question(20 + i))
    two.run_until_idle()
    assert two.loads_checked == len(prefixes)
    assert two.manager.tiers.tiers[0].statistics().blocks_read >= len(prefixes) * 5


def test_bad_tier_settings_are_refused_naming_them(tmp_path: Path) -> None:
    base = {**AIOKVO_SPEC, "cpu_bytes_to_use": 1 << 20}
    with pytest.raises(ConfigError, match="aiokvo_tiers"):
        check_extra_config({**base, "aiokvo_tiers": {"kind": "disk"}})
    with pytest.raises(ConfigError, match=r"aiokvo_tiers'\]\[0\].*capacity_bytes"):
        check_extra_config({**base, "aiokvo_tiers": [{"kind": "disk", "root": str(tmp_path)}]})
    with pytest.raises(ConfigError, match="tape"):
        check_extra_config({**base, "aiokvo_tiers": [{"kind": "tape"}]})
    good = {**base, **disk(tmp_path)}
    assert check_extra_config(good)["aiokvo_tiers"] == good["aiokvo_tiers"]
    definitions = metric_definitions(good)
    assert definitions[TIER_READ].labelnames == ("medium",)
    assert TIER_READ not in metric_definitions(base)


def test_a_request_whose_tier_filter_leaves_out_storage_is_not_promoted(
    harness_factory: Any, tmp_path: Path
) -> None:
    """vLLM 0.33's ``ReqContext.load_tier_filter``: the disk tier is local STORAGE."""
    base = pytest.importorskip("vllm.v1.kv_offload.base")
    if not hasattr(base, "TierFilter"):
        pytest.skip("vLLM 0.32 has no tier filters")
    from types import SimpleNamespace

    h = harness_factory(spec=dict(AIOKVO_SPEC), extra=disk(tmp_path))
    h.add(docs(1)[0] + question(0))
    h.run_until_idle()
    settle(h)
    core = h.manager.aiokvo_manager
    keys = [key for key, _ in core.policy.items()]
    assert keys
    assert h.sched.reset_prefix_cache(reset_connector=True)  # the pool is empty now
    f, m = base.TierFilter, base.TierMatcher
    cpu_only = SimpleNamespace(load_tier_filter=f(matchers=(m(medium=base.Medium.CPU),)))
    remote = SimpleNamespace(load_tier_filter=f(matchers=(m(locality=base.Locality.REMOTE),)))
    local = SimpleNamespace(load_tier_filter=f(matchers=(m(medium=base.Medium.STORAGE,
                                                            locality=base.Locality.LOCAL),)))
    miss, pending = base.LookupResult.MISS, base.LookupResult.HIT_PENDING
    assert h.manager.lookup(keys[0], cpu_only) == miss
    assert h.manager.lookup(keys[0], remote) == miss
    assert h.manager.lookup(keys[0], local) == pending
    assert h.manager.lookup(keys[0], cpu_only) == miss  # queued, but not for this request
    assert h.manager.lookup(keys[0], SimpleNamespace(load_tier_filter=f.ALL)) == pending
    settle(h)
    assert h.manager.lookup(keys[0], cpu_only) == base.LookupResult.HIT  # in the pool now


def test_blocks_that_went_bad_on_disk_are_recomputed_never_served(
    harness_factory: Any, tmp_path: Path
) -> None:
    """The slab's bytes overwritten after the writes: every promotion fails its
    checksums, the keys answer miss from then on (no request waits forever), and the
    harness sees the right KV in every block attended."""
    h = harness_factory(spec=dict(AIOKVO_SPEC), extra=disk(tmp_path))
    prefixes = docs(2)
    for i, d in enumerate(prefixes):
        h.add(d + question(i))
    h.run_until_idle()
    settle(h)
    data = sorted(tmp_path.glob("v*/slab-*.data"))
    assert data
    for path in data:
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.write(bytes([0xA5]) * size)
    assert h.sched.reset_prefix_cache(reset_connector=True)
    before = h.loads_checked
    ids = [h.add(d + question(30 + i)) for i, d in enumerate(prefixes)]
    h.run_until_idle()
    assert all(h.finished(r) for r in ids)
    assert h.loads_checked == before  # nothing loaded: the disk's bytes were bad
    tier = h.manager.tiers.tiers[0].statistics()
    assert tier.checksum_failures >= len(prefixes) and tier.blocks_read == 0
    own = h.manager.tiers.statistics()
    assert own.promotion_failures >= len(prefixes) and own.promoted_blocks == 0
    assert h.stats_counters["vllm:kv_offload_aiokvo_tier_checksum_failures"] > 0


_CLUSTER: list[Any] = []  # the fake Mooncake cluster the "mooncake" kind is built over


def fake_mooncake_tier(config: Any) -> Any:
    """The ``"mooncake"`` tier kind over this test's in-process cluster."""
    from aiokvo.tiers.mooncake.tier import mooncake_tier

    return mooncake_tier(config, store_factory=_CLUSTER[0].store)


def test_a_replica_loads_what_another_put_in_mooncake(
    harness_factory: Any, tmp_path: Path
) -> None:
    """Two engines over one (in-process) Mooncake cluster: the second's pool misses,
    its Mooncake index has never seen the keys, so the lookup answers RETRY while
    the cluster is asked off the step, then HIT_PENDING and a promotion."""
    from aiokvo.testing.mooncake_fake import FakeMooncakeCluster
    from aiokvo.tiers.registry import register_tier_kind

    _CLUSTER[:] = [FakeMooncakeCluster()]
    config = "aiokvo.tiers.mooncake.config:MooncakeTierConfig"
    register_tier_kind("mooncake", config, f"{__name__}:fake_mooncake_tier")
    try:
        extra = {"aiokvo_tiers": [{"kind": "mooncake", "master_server_addr": "127.0.0.1:1",
                                   "local_hostname": "127.0.0.1", "lookup_timeout": 5.0}]}
        prefixes = docs(2)
        one = harness_factory(spec=dict(AIOKVO_SPEC), extra=extra)
        for i, d in enumerate(prefixes):
            one.add(d + question(i))
        one.run_until_idle()
        settle(one)
        assert one.manager.tiers.tiers[0].statistics().blocks_written >= len(prefixes) * 5
        two = harness_factory(spec=dict(AIOKVO_SPEC), extra=extra)
        for i, d in enumerate(prefixes):
            two.add(d + question(40 + i))
        two.run_until_idle()
        assert two.lookup_results["RETRY"] > 0
        assert two.loads_checked == len(prefixes)  # checked byte for byte
        assert two.manager.tiers.tiers[0].statistics().blocks_read >= len(prefixes) * 5
    finally:
        register_tier_kind("mooncake", config, "aiokvo.tiers.mooncake.tier:mooncake_tier")
        _CLUSTER.clear()


def counters(manager: Any) -> dict[str, float]:
    """What one ``get_stats`` reports (counters report what changed since the last),
    summed over labels; read off the payload as vLLM's loggers do (0.32 and 0.33)."""
    data = manager.get_stats().data["data"]
    return {name: sum(v for v in per_label.values() if isinstance(v, int | float))
            for name, per_label in data.items()}


def tiered_spec(tmp_path: Path, engine_id: str) -> Any:
    import dataclasses

    from aiokvo.integrations.vllm import AiokvoOffloadingSpec
    from tests.integrations.vllm.test_spec import config

    cfg = config({"cpu_bytes_to_use": 1 << 20, **disk(tmp_path)}, bytes_per_block=8192)
    return AiokvoOffloadingSpec(dataclasses.replace(cfg, engine_id=engine_id))


def test_the_spec_shares_its_pool_and_declares_every_tier_stat(tmp_path: Path) -> None:
    spec = tiered_spec(tmp_path, "tiers-stats")
    assert spec.aiokvo_config.instance_id == "tiers-stats"  # a shared pool, even for one rank
    (tier_config,) = spec.tier_configs
    assert tier_config.model_id == "tiny"  # vLLM's model name, where the tier names none
    manager = spec.get_manager()
    try:
        assert manager.tiers is not None
        stats = manager.get_stats()
        declared = type(spec).build_metric_definitions(dict(spec.config.extra_config))
        for name, per_label in stats.data["data"].items():
            assert name in declared, name
            for labels in per_label:
                assert len(labels) == len(declared[name].labelnames), (name, labels)
        assert ("DISK",) in stats.data["data"]["vllm:kv_offload_aiokvo_tier_breaker_state"]
    finally:
        manager.shutdown()


def test_tiers_refuse_a_scheduler_thread_that_runs_an_event_loop(tmp_path: Path) -> None:
    import asyncio

    spec = tiered_spec(tmp_path, "tiers-loop")

    async def build() -> None:
        spec.get_manager()

    with pytest.raises(ConfigError, match="runs an event loop"):
        asyncio.run(build())


@pytest.mark.parametrize("kind", ["kv.demote", "kv.durable"])
def test_demote_and_durable_hints_commit_the_requests_blocks_to_the_disk(
    tmp_path: Path, kind: str
) -> None:
    """vLLM 0.33's kv_hints with a tier: the request's blocks are written to the disk
    when it finishes, past the admission filter; a demote then frees them in the pool."""
    hints = pytest.importorskip("tests.integrations.vllm.test_hints")  # skips on 0.32
    from aiokvo.integrations.vllm.metrics import KV_HINTS_EXECUTED, KV_HINTS_IGNORED

    spec = tiered_spec(tmp_path, f"tiers-{kind}")
    manager = spec.get_manager()
    try:
        tiers = manager.tiers
        keys = hints.keys("r", 4)
        payload: dict[str, Any] = {"tier": "disk"} if kind == "kv.durable" else {}
        hints.serve(manager, hints.request("r", hints.action(kind, payload)), keys)
        end = time.monotonic() + 60
        while tiers.has_pending_work():
            assert time.monotonic() < end
            manager.on_schedule_end(None)
            time.sleep(0.005)
        disk_tier = tiers.tiers[0]
        assert sorted(disk_tier.committed(keys)) == sorted(keys)
        in_pool = [k for k in keys if manager.aiokvo_manager.lookup(k, None)]
        assert in_pool == ([] if kind == "kv.demote" else keys)
        assert tiers.statistics().demoted_blocks == (4 if kind == "kv.demote" else 0)
        got = counters(manager)
        assert (got.get(KV_HINTS_EXECUTED), got.get(KV_HINTS_IGNORED)) == (1, None)
        # A tier that is not there: ignored, counted.
        hints.serve(manager, hints.request("s", hints.action("kv.durable", {"tier": "tape"})),
                    hints.keys("s", 2))
        assert counters(manager).get(KV_HINTS_IGNORED) == 1
    finally:
        manager.shutdown()
