"""OffloadConfig: validation naming field and value, from_dict, pool sizing."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest

from aiokvo.config import EXTRA_CONFIG_KEYS, OffloadConfig, UnknownConfigKeyWarning
from aiokvo.errors import ConfigError
from aiokvo.tiers import DiskTierConfig, MooncakeTierConfig

GIB = 1 << 30


def make(**overrides: Any) -> OffloadConfig:
    fields: dict[str, Any] = {
        "gpu_block_sizes": (16,),
        "hash_block_size": 16,
        "cpu_bytes_to_use": GIB,
        "kv_bytes_per_block": 1 << 20,
    }
    fields.update(overrides)
    return OffloadConfig(**fields)


def test_defaults_follow_vllm() -> None:
    config = make()
    assert config.offloaded_block_size is None
    assert config.block_size_factor == 1
    assert config.eviction_policy == "lru"
    assert config.store_threshold == 0
    assert config.max_tracker_size == 64_000
    assert config.enable_events is False
    assert config.world_size == 1
    assert config.rank == 0
    assert config.instance_id is None
    assert config.spec_name == "CPUOffloadingSpec"
    assert config.spec_module_path is None


def test_is_frozen_and_keyword_only() -> None:
    config = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cpu_bytes_to_use = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        OffloadConfig((16,), 16, GIB, 1)  # type: ignore[misc]


def test_gpu_block_sizes_list_is_stored_as_tuple() -> None:
    config = make(gpu_block_sizes=[32, 64], hash_block_size=16)
    assert config.gpu_block_sizes == (32, 64)
    assert hash(config) == hash(make(gpu_block_sizes=(32, 64), hash_block_size=16))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpu_block_sizes", ()),
        ("gpu_block_sizes", "16"),
        ("gpu_block_sizes", 16),
        ("gpu_block_sizes", (16, 0)),
        ("gpu_block_sizes", (16, 16.0)),
        ("hash_block_size", 0),
        ("hash_block_size", -16),
        ("hash_block_size", "16"),
        ("cpu_bytes_to_use", 0),
        ("cpu_bytes_to_use", -1),
        ("cpu_bytes_to_use", None),
        ("cpu_bytes_to_use", 1.5),
        ("kv_bytes_per_block", -1),
        ("kv_bytes_per_block", True),
        ("offloaded_block_size", 0),
        ("offloaded_block_size", "32"),
        ("eviction_policy", ""),
        ("eviction_policy", None),
        ("store_threshold", -1),
        ("store_threshold", 2.0),
        ("max_tracker_size", 0),
        ("enable_events", 1),
        ("world_size", 0),
        ("world_size", False),
        ("rank", -1),
        ("rank", 1),  # world_size is 1
        ("rank", 0.0),
        ("instance_id", ""),
        ("instance_id", "../etc"),
        ("instance_id", ".hidden"),
        ("instance_id", 7),
        ("spec_name", ""),
        ("spec_name", 3),
        ("spec_module_path", ""),
        ("spec_module_path", b"pkg.mod"),
    ],
)
def test_bad_field_raises_config_error_naming_field_and_value(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        make(**{field: value})
    message = str(info.value)
    assert field in message
    assert repr(value) in message or str(value) in message


def test_gpu_block_size_must_divide_by_hash_block_size() -> None:
    make(gpu_block_sizes=(32, 64), hash_block_size=16)  # fine
    with pytest.raises(ConfigError, match=r"gpu_block_sizes entry 40 .*hash_block_size=16"):
        make(gpu_block_sizes=(32, 40), hash_block_size=16)


def test_offloaded_block_size_gives_the_factor() -> None:
    config = make(gpu_block_sizes=(16, 16), offloaded_block_size=64)
    assert config.block_size_factor == 4


def test_offloaded_block_size_must_be_a_multiple() -> None:
    with pytest.raises(ConfigError, match=r"offloaded_block_size=40 .*multiple .* 16"):
        make(offloaded_block_size=40)


def test_offloaded_block_size_needs_one_gpu_block_size() -> None:
    with pytest.raises(ConfigError, match=r"offloaded_block_size=64 .*\(16, 32\)"):
        make(gpu_block_sizes=(16, 32), offloaded_block_size=64)


def test_rank_and_instance_id_name_this_rank_of_a_shared_pool() -> None:
    config = make(world_size=4, rank=3, instance_id="engine-7.a_b")
    assert (config.rank, config.instance_id) == (3, "engine-7.a_b")
    with pytest.raises(ConfigError, match=r"rank must be an int in 0\.\.3, got 4"):
        make(world_size=4, rank=4)


# -- pool sizing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpu_bytes", "kv_bytes", "world_size", "offloaded", "expected"),
    [
        (GIB, 1 << 20, 1, None, 1024),
        (GIB, 1 << 20, 4, None, 256),
        (GIB, 1 << 20, 2, 64, 128),  # factor 4 * world 2 -> 8 MiB per block
        (GIB + (1 << 20) - 1, 1 << 20, 1, None, 1024),  # rounds down
        (1000, 3, 1, None, 333),
        (GIB, 0, 1, None, 0),  # an engine with no KV blocks sizes an empty pool
        (10, 1 << 20, 1, None, 0),  # budget smaller than one block
    ],
)
def test_num_cpu_blocks(
    cpu_bytes: int, kv_bytes: int, world_size: int, offloaded: int | None, expected: int
) -> None:
    config = make(
        cpu_bytes_to_use=cpu_bytes,
        kv_bytes_per_block=kv_bytes,
        world_size=world_size,
        offloaded_block_size=offloaded,
    )
    assert config.num_cpu_blocks == expected
    factor = 1 if offloaded is None else offloaded // 16
    assert config.kv_bytes_per_offloaded_block == kv_bytes * world_size * factor


# -- from_dict ---------------------------------------------------------------------


def from_dict(extra: dict[str, Any], **kwargs: Any) -> OffloadConfig:
    engine: dict[str, Any] = {
        "gpu_block_sizes": (16,),
        "hash_block_size": 16,
        "kv_bytes_per_block": 1 << 20,
    }
    engine.update(kwargs)
    return OffloadConfig.from_dict(extra, **engine)


def test_from_dict_reads_every_vllm_key() -> None:
    config = from_dict(
        {
            "cpu_bytes_to_use": 8 * GIB,
            "block_size": 48,
            "eviction_policy": "arc",
            "store_threshold": 3,
            "max_tracker_size": 500,
            "spec_name": "MySpec",
            "spec_module_path": "my_pkg.specs",
        },
        world_size=2,
        rank=1,
        instance_id="engine0",
        enable_events=True,
    )
    assert config == OffloadConfig(
        gpu_block_sizes=(16,),
        hash_block_size=16,
        cpu_bytes_to_use=8 * GIB,
        kv_bytes_per_block=1 << 20,
        offloaded_block_size=48,
        eviction_policy="arc",
        store_threshold=3,
        max_tracker_size=500,
        enable_events=True,
        world_size=2,
        rank=1,
        instance_id="engine0",
        spec_name="MySpec",
        spec_module_path="my_pkg.specs",
    )
    assert config.block_size_factor == 3
    assert config.num_cpu_blocks == 8 * GIB // ((1 << 20) * 2 * 3)


def test_from_dict_defaults() -> None:
    assert from_dict({"cpu_bytes_to_use": GIB}) == make()


def test_from_dict_accepts_numeric_strings_and_integral_floats() -> None:
    config = from_dict(
        {
            "cpu_bytes_to_use": " 1073741824 ",
            "block_size": "32",
            "store_threshold": "2",
            "max_tracker_size": 1e3,
        }
    )
    assert (config.cpu_bytes_to_use, config.offloaded_block_size) == (GIB, 32)
    assert (config.store_threshold, config.max_tracker_size) == (2, 1000)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cpu_bytes_to_use", "lots"),
        ("cpu_bytes_to_use", 1.5),
        ("cpu_bytes_to_use", True),
        ("block_size", "16.5"),
        ("store_threshold", [2]),
        ("max_tracker_size", float("inf")),
        ("eviction_policy", 3),
        ("spec_module_path", 7),
    ],
)
def test_from_dict_rejects_unparsable_values_naming_the_key(key: str, value: Any) -> None:
    extra: dict[str, Any] = {"cpu_bytes_to_use": GIB, key: value}
    with pytest.raises(ConfigError) as info:
        from_dict(extra)
    assert key in str(info.value)
    assert repr(value) in str(info.value)


def test_from_dict_requires_cpu_bytes_to_use() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        from_dict({"block_size": 32})
    with pytest.raises(ConfigError, match="cpu_bytes_to_use must be an int >= 1, got 0"):
        from_dict({"cpu_bytes_to_use": "0"})


def test_from_dict_checks_engine_values_too() -> None:
    with pytest.raises(ConfigError, match="hash_block_size"):
        from_dict({"cpu_bytes_to_use": GIB}, gpu_block_sizes=(16,), hash_block_size=32)
    with pytest.raises(ConfigError, match=r"world_size must be an int in 1\.\.65536, got 0"):
        from_dict({"cpu_bytes_to_use": GIB}, world_size=0)


def test_from_dict_warns_about_unknown_keys_and_ignores_them() -> None:
    with pytest.warns(UnknownConfigKeyWarning, match=r"\['blocksize'\]"):
        config = from_dict({"cpu_bytes_to_use": GIB, "blocksize": 64})
    assert config.offloaded_block_size is None


def test_from_dict_strict_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"\['evict_policy'\]"):
        from_dict({"cpu_bytes_to_use": GIB, "evict_policy": "arc"}, strict=True)


def test_from_dict_known_keys_do_not_warn() -> None:
    extra = {"cpu_bytes_to_use": GIB, "eviction_policy": "lru", "spec_name": "CPUOffloadingSpec"}
    assert set(extra) <= EXTRA_CONFIG_KEYS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_dict(extra)


def _tiers_from_dict(*tiers: object) -> OffloadConfig:
    return OffloadConfig.from_dict(
        {"cpu_bytes_to_use": 1 << 20, "tiers": list(tiers)},
        gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=4096,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "missing"),
    [
        ({"kind": "disk", "root": "/tmp/t", "model_id": "m"}, "capacity_bytes"),
        ({"kind": "disk"}, "capacity_bytes, model_id, root"),
        ({"kind": "mooncake", "model_id": "m"}, "master_server_addr"),
    ],
)
def test_from_dict_tiers_missing_required_keys_raise_config_error_naming_them(
    settings: dict[str, Any], missing: str
) -> None:
    pattern = f"(?i)missing {settings['kind']} tier settings: {missing} must be given"
    with pytest.raises(ConfigError, match=pattern):
        _tiers_from_dict(settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ("disk", "tiers must be a list"),
        ({"kind": "disk"}, "tiers must be a list"),  # one mapping, not a list of them
        (["disk"], "a tier's settings must be a mapping"),
        ([{"root": "/tmp/t"}], "unknown tier kind None; known: disk, mooncake"),
        ([{"kind": "tape"}], "unknown tier kind 'tape'"),
        ([{"kind": "disk", "root": "/tmp/t", "capacity_bytes": 1, "model_id": "m",
           "capacity": 2}], r"unknown disk tier settings \['capacity'\]"),
        ([{"kind": "disk", "root": "/tmp/t", "capacity_bytes": "1.5", "model_id": "m"}],
         "capacity_bytes must be an integer, got '1.5'"),
        ([{"kind": "disk", "root": "/tmp/t", "capacity_bytes": 1, "model_id": "m",
           "io_timeout": "soon"}], "io_timeout must be a number of seconds, got 'soon'"),
    ],
)
def test_from_dict_bad_tiers_raise_config_error(settings: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict(
            {"cpu_bytes_to_use": 1 << 20, "tiers": settings},
            gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=4096,
        )  # fmt: skip


def test_from_dict_tiers_read_numbers_as_strings_the_same_way_for_every_kind() -> None:
    disk = {"kind": "disk", "root": "/tmp/t", "model_id": "m", "capacity_bytes": "1048576",
            "max_write_blocks": "8", "io_timeout": "2.5", "refresh_interval": "0",
            "reset_after": 1e1}
    moon = {"kind": "mooncake", "master_server_addr": "10.0.0.5:50051", "model_id": "m",
            "max_write_blocks": "8", "io_timeout": "2.5"}
    d, m = _tiers_from_dict(disk, moon).tiers
    assert isinstance(d, DiskTierConfig) and isinstance(m, MooncakeTierConfig)
    assert (d.capacity_bytes, d.max_write_blocks, d.io_timeout) == (1 << 20, 8, 2.5)
    assert (d.refresh_interval, d.reset_after) == (0.0, 10.0)
    assert (m.max_write_blocks, m.io_timeout) == (8, 2.5)


# -- absurd sizes and shapes (issue 22 §4) -----------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpu_block_sizes", (1 << 40,)),
        ("hash_block_size", 1 << 40),
        ("kv_bytes_per_block", 1 << 70),
        ("offloaded_block_size", 16 << 40),
        ("store_threshold", 1 << 70),
        ("max_tracker_size", 1 << 70),
        ("world_size", 1 << 40),
        ("cpu_bytes_to_use", 1 << 70),  # not an int64: torch could not even be asked
        ("cpu_bytes_to_use", 1 << 62),  # more memory than any machine has
    ],
)
def test_absurd_sizes_raise_config_error_naming_field_and_value(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError) as info:
        make(**kwargs)
    message = str(info.value)
    assert field in message
    shown = value[0] if isinstance(value, tuple) else value
    assert str(shown) in message


def test_a_pool_of_more_blocks_than_block_ids_hold_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"num_cpu_blocks=.* more than 2147483647"):
        make(cpu_bytes_to_use=4 << 30, kv_bytes_per_block=1)


def test_a_pool_bigger_than_this_machine_names_its_memory() -> None:
    import os

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ConfigError, match=f"this machine's memory \\({memory} bytes\\)"):
        make(cpu_bytes_to_use=memory + 1)
    assert make(cpu_bytes_to_use=memory // 2).cpu_bytes_to_use == memory // 2


@pytest.mark.parametrize("extra", [None, [("cpu_bytes_to_use", 1 << 30)], "cpu_bytes_to_use", 7])
def test_from_dict_given_something_that_is_not_a_mapping_raises_config_error(
    extra: Any,
) -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config must be a mapping") as info:
        from_dict(extra)
    assert repr(extra) in str(info.value)
