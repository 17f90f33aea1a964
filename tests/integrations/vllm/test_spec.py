"""The spec vLLM loads by name: construction, pool size, metrics, refused settings."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from aiokvo.errors import ConfigError
from aiokvo.integrations.vllm import AiokvoOffloadingManager, AiokvoOffloadingSpec
from aiokvo.integrations.vllm._compat import check_vllm_version

BASE = {"spec_name": "AiokvoOffloadingSpec", "spec_module_path": "aiokvo.integrations.vllm"}


def config(extra: dict[str, Any], *, bytes_per_block: int = 12_000, bpc: int = 1,
           world: int = 1, canonical: bool = False) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer0",), 0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=True,
        extra_config={**BASE, **extra},
        engine_id="engine-0",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        canonical_layout=canonical,
    )  # fmt: skip


def test_vllms_factory_loads_the_spec_from_the_config_line() -> None:
    cls = OffloadingSpecFactory.get_spec_cls(dict(BASE))
    assert cls is AiokvoOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(config({"cpu_bytes_to_use": 1 << 20}))
    assert isinstance(spec, AiokvoOffloadingSpec)
    # What the connector reads off every spec, from vLLM's base __init__.
    assert (spec.blocks_per_chunk, spec.tokens_per_block, spec.offload_prompt_only) == (
        1, (16,), True
    )
    assert isinstance(spec.get_manager(), AiokvoOffloadingManager)
    assert spec.get_manager() is spec.get_manager()


@pytest.mark.parametrize(("bytes_per_block", "bpc", "world", "budget"), [
    (12_000, 1, 1, 1 << 20), (12_000, 2, 1, 1 << 20), (4096, 1, 1, 10 * 4096),
    (5000, 3, 2, 7 << 20), (1, 1, 1, 4096 * 3 + 5),
])  # fmt: skip
def test_the_pool_has_as_many_chunks_as_vllms_own_spec(
    bytes_per_block: int, bpc: int, world: int, budget: int
) -> None:
    extra = {"cpu_bytes_to_use": budget}
    ours = AiokvoOffloadingSpec(config(extra, bytes_per_block=bytes_per_block, bpc=bpc,
                                       world=world))
    native = CPUOffloadingSpec(config(extra, bytes_per_block=bytes_per_block, bpc=bpc,
                                      world=world))
    assert ours.num_chunks == native.num_chunks > 0
    assert ours.get_manager().aiokvo_manager.num_blocks == native.num_chunks


@pytest.mark.parametrize("threshold", [0, 2])
def test_every_stats_key_is_declared(threshold: int) -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "store_threshold": threshold}
    spec = AiokvoOffloadingSpec(config(extra))
    manager = spec.get_manager()
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    keys = [make_offload_key(b"k%d" % i, 0) for i in range(3)]
    manager.prepare_store(keys, ctx)
    manager.prepare_store(keys, ctx)
    stats = manager.get_stats()
    declared = AiokvoOffloadingSpec.build_metric_definitions(extra)
    emitted = set(stats.data["data"])
    assert emitted <= set(declared), emitted - set(declared)
    assert ("vllm:kv_offload_stores_skipped" in emitted) == (threshold >= 2)


@pytest.mark.parametrize(("extra", "match"), [
    ({}, r"\['cpu_bytes_to_use'\] must be given"),
    ({"cpu_bytes_to_use": "lots"}, r"\['cpu_bytes_to_use'\] must be an integer .*, got 'lots'"),
    ({"cpu_bytes_to_use": 1 << 20, "aiokvo_loops": "pump"}, "unknown aiokvo keys"),
    ({"cpu_bytes_to_use": 1 << 20, "aiokvo_loop": "fast"}, "aiokvo_loop must be one of"),
    ({"cpu_bytes_to_use": 1 << 20, "aiokvo_retries": -1},
     r"\['aiokvo_retries'\] must be an integer 0\.\.100, got -1"),
    ({"cpu_bytes_to_use": 1 << 20, "store_threshold": "two"},
     r"\['store_threshold'\] must be an integer .*, got 'two'"),
    ({"cpu_bytes_to_use": 1 << 20, "aiokvo_handler_options": {"copy_thread": 4}},
     r"\['copy_thread'\] = 4: not a handler option"),
    ({"cpu_bytes_to_use": 1 << 20, "aiokvo_handler_options": 3}, "must be a mapping"),
    ({"cpu_bytes_to_use": 1 << 20, "cache_policy_module_path": "x"}, "cache_policy_module_path"),
    ({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "mru"}, "unknown cache policy 'mru'"),
])  # fmt: skip
def test_bad_settings_are_config_errors_naming_them(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AiokvoOffloadingSpec(config(extra)).get_manager()


def test_canonical_layout_and_vllm_before_032_are_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ConfigError, match="canonical_layout is not supported"):
        AiokvoOffloadingSpec(config({"cpu_bytes_to_use": 1 << 20}, canonical=True))
    for version in ("0.32.0", "0.32.7+cpu", "0.33.0", "0.33.2rc1"):
        check_vllm_version(version)
    assert not caplog.records
    for version in ("0.31.9", "0.9.2", "main"):
        with pytest.raises(ConfigError, match=f"vLLM {version} is installed"):
            check_vllm_version(version)
    check_vllm_version("0.34.0")  # untested: used, with a warning
    assert "vLLM 0.34.0 is installed" in caplog.text


@pytest.mark.parametrize(("bytes_per_block", "bpc", "world"), [(12_000, 1, 1), (5000, 3, 2)])
def test_config_info_is_vllms_own(bytes_per_block: int, bpc: int, world: int) -> None:
    """vLLM 0.33's ``vllm:kv_offload_config_info``: the same labels and values as its
    CPU spec's; on 0.32 (no such metric) the methods are there and unused."""
    extra = {"cpu_bytes_to_use": 7 << 20}
    ours = AiokvoOffloadingSpec(config(extra, bytes_per_block=bytes_per_block, bpc=bpc,
                                       world=world))
    info = ours.get_manager().config_info()
    assert list(info[0]) == list(AiokvoOffloadingSpec.config_info_keys(extra))
    assert info[0]["cpu_num_chunks"] == ours.num_chunks > 0
    native_cls: Any = CPUOffloadingSpec
    if not hasattr(native_cls, "config_info_keys"):
        return  # vLLM 0.32
    native = native_cls(config(extra, bytes_per_block=bytes_per_block, bpc=bpc, world=world))
    assert AiokvoOffloadingSpec.config_info_keys(extra) == native_cls.config_info_keys(extra)
    assert info == list(native.get_manager().config_info())
