"""The opt-in keyed integrity check: a client of the cluster without the deployment's
key cannot plant a block that a keyed tier serves."""

from __future__ import annotations

import os
from typing import Any

import pytest

from aiokvo import Offloader
from aiokvo.errors import ConfigError
from aiokvo.testing import FakeMooncakeCluster
from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.mooncake import MooncakeStore, MooncakeTier, MooncakeTierConfig
from tests.offloader._harness import KV, keys

KEY = os.urandom(32).hex()
CPU = 8


def tier(cluster: FakeMooncakeCluster, **settings: Any) -> StoreTier:
    options: dict[str, Any] = {"model_id": "m", "local_hostname": "127.0.0.1"}
    return MooncakeTier("127.0.0.1:1", store_factory=cluster.store, **options, **settings)


def store_of(t: StoreTier) -> MooncakeStore:
    assert isinstance(t.store, MooncakeStore)
    return t.store


async def write(cluster: FakeMooncakeCluster, ks: list[bytes], **settings: Any) -> StoreTier:
    kv, t = KV(), tier(cluster, **settings)
    async with Offloader(kv.config(CPU), kv.caches, tiers=[t]) as off:
        kv.write(list(range(len(ks))), ks)  # type: ignore[arg-type]
        assert (await off.store(ks, list(range(len(ks))))).ok  # type: ignore[arg-type]
        await off.drain()
    return t


async def read(cluster: FakeMooncakeCluster, ks: list[bytes], **settings: Any) -> tuple[int, Any]:
    kv, t = KV(), tier(cluster, **settings)
    async with Offloader(kv.config(CPU), kv.caches, tiers=[t]) as off:
        n = await off.load_prefix(ks, list(range(len(ks))))  # type: ignore[arg-type]
        assert n == 0 or kv.holds(list(range(n)), ks[:n])  # type: ignore[arg-type]
        (stats,) = off.statistics().tiers
    return n, stats


async def test_keyed_blocks_round_trip_and_live_apart_from_plain_and_other_keys() -> None:
    cluster = FakeMooncakeCluster()
    ks = keys("a", "b", "c")
    keyed = await write(cluster, ks, integrity_key=KEY)
    assert "-k" in store_of(keyed).namespace
    assert (await read(cluster, ks, integrity_key=KEY))[0] == 3
    assert (await read(cluster, ks))[0] == 0  # a plain tier never sees keyed objects
    assert (await read(cluster, ks, integrity_key=os.urandom(16).hex()))[0] == 0


async def test_a_client_without_the_key_cannot_plant_a_block() -> None:
    cluster = FakeMooncakeCluster()
    ks = keys("p", "q")
    keyed = await write(cluster, ks, integrity_key=KEY)
    name = store_of(keyed).object_name(ks[1])
    good = cluster.objects[name]
    # The attacker writes bytes of its choosing under the same name, trailer and all:
    # the right magic, layout, key hash and length, a nonce, and a forged tag.
    forged = bytearray(good)
    forged[: len(good) - 64] = os.urandom(len(good) - 64)
    forged[-12:] = os.urandom(12)
    cluster.objects[name] = bytes(forged)
    n, stats = await read(cluster, ks, integrity_key=KEY)
    assert n == 1  # the planted block is a miss, never data
    assert stats.failure_causes == {"bad_mac": 1} and stats.checksum_failures == 1
    assert name not in cluster.objects  # and removed from the cluster
    # Copying another key's valid object under this name fails too: the key is covered.
    keyed = await write(cluster, ks, integrity_key=KEY)
    cluster.objects[store_of(keyed).object_name(ks[1])] = cluster.objects[
        store_of(keyed).object_name(ks[0])
    ]
    assert (await read(cluster, ks, integrity_key=KEY))[0] == 1


def test_a_bad_key_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigError, match="15 bytes") as info:
        MooncakeTierConfig(master_server_addr="127.0.0.1:1", model_id="m",
                           integrity_key="ab" * 15)  # fmt: skip
    assert "ab" * 15 not in str(info.value)
    with pytest.raises(ConfigError, match="hex"):
        MooncakeTierConfig(master_server_addr="127.0.0.1:1", model_id="m", integrity_key="zz")
    config = MooncakeTierConfig(master_server_addr="127.0.0.1:1", model_id="m",
                                integrity_key=KEY)  # fmt: skip
    assert KEY not in repr(config)
