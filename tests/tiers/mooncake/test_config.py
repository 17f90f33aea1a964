"""MooncakeTierConfig: validation naming the bad value, from_dict, and OffloadConfig's tiers."""

from __future__ import annotations

from typing import Any

import pytest

from aiokvo import OffloadConfig
from aiokvo.errors import ConfigError
from aiokvo.tiers import build_tier
from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.mooncake import MooncakeStore, MooncakeTierConfig

BASE: dict[str, Any] = {"master_server_addr": "10.0.0.5:50051", "model_id": "llama-3-8b"}


def test_defaults_are_a_pure_tcp_client_with_p2p_metadata() -> None:
    config = MooncakeTierConfig(**BASE)
    assert config.metadata_server == "P2PHANDSHAKE"
    assert (config.protocol, config.global_segment_size, config.replica_num) == ("tcp", 0, 1)
    assert config.key_prefix == "aiokvo"
    assert config.effective_rpc_timeout == config.io_timeout
    settings = config.setup_settings("10.0.0.7")
    assert settings.local_hostname == "10.0.0.7"
    assert settings.master_server_addr == "10.0.0.5:50051"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("master_server_addr", "10.0.0.5"),
        ("master_server_addr", "host:port"),
        ("model_id", ""),
        ("protocol", "TCP over carrier pigeon"),
        ("key_prefix", "/abs"),
        ("key_prefix", "a b"),
        ("key_prefix", ""),
        ("replica_num", 0),
        ("replica_num", True),
        ("global_segment_size", -1),
        ("io_timeout", 0),
        ("lookup_timeout", float("inf")),
        ("reset_after", "1"),
        ("enable_ssd_offload", "yes"),
        ("row_trailers", 1),
        ("client_http_port", 70000),
        ("max_write_blocks", 0),
    ],
)
def test_a_bad_value_is_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        MooncakeTierConfig(**{**BASE, field: value})


def test_max_reset_after_below_reset_after_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_reset_after"):
        MooncakeTierConfig(**BASE, reset_after=10.0, max_reset_after=5.0)


def test_from_dict_reads_strings_and_refuses_unknown_keys() -> None:
    config = MooncakeTierConfig.from_dict(
        {"kind": "mooncake", **BASE, "replica_num": "2", "io_timeout": "2.5",
         "global_segment_size": 1073741824.0, "protocol": "rdma", "rdma_devices": "mlx5_0"}
    )  # fmt: skip
    assert (config.replica_num, config.io_timeout) == (2, 2.5)
    assert config.global_segment_size == 1 << 30
    with pytest.raises(ConfigError, match="replicas"):
        MooncakeTierConfig.from_dict({**BASE, "replicas": 2})
    with pytest.raises(ConfigError, match="replica_num"):
        MooncakeTierConfig.from_dict({**BASE, "replica_num": "two"})


def test_offload_config_from_dict_builds_the_tier() -> None:
    config = OffloadConfig.from_dict(
        {
            "cpu_bytes_to_use": 1 << 20,
            "tiers": [{"kind": "mooncake", **BASE, "key_prefix": "prod", "replica_num": 2}],
        },
        gpu_block_sizes=(16,),
        hash_block_size=16,
        kv_bytes_per_block=4096,
    )
    (tier_config,) = config.tiers
    assert isinstance(tier_config, MooncakeTierConfig)
    tier = build_tier(tier_config)
    assert isinstance(tier, StoreTier) and isinstance(tier.store, MooncakeStore)
    assert (tier.store.config.key_prefix, tier.store.config.replica_num) == ("prod", 2)
    assert tier.store.config == tier_config and tier.settings == tier_config
