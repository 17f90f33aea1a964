"""The plugin's offloader fixtures and the Offloader leak check."""

from __future__ import annotations

import pytest

# Imported before any in-process inner run (see test_plugin.py).
import torch  # noqa: F401

from aiokvo import ReqContext, make_offload_key
from aiokvo.errors import ConfigError
from aiokvo.testing import OffloaderFactory, make_kv_caches, offload_config, offloader_leaks

pytest_plugins = ["pytester"]

INI = """
[pytest]
asyncio_mode = {mode}
asyncio_default_fixture_loop_scope = function
filterwarnings = ignore::pytest.PytestAssertRewriteWarning
"""

ROUND_TRIP = """
import pytest
from aiokvo import make_offload_key

KEYS = [make_offload_key(bytes([i]) * 16, 0) for i in range(4)]

{marker}
async def test_default_offloader_round_trip(offloader):
    assert offloader.config.num_cpu_blocks == 32
    result = await offloader.store(KEYS, [0, 1, 2, 3])
    assert list(result.stored) == KEYS
    assert await offloader.load_prefix(KEYS, [8, 9, 10, 11]) == 4
    for t in offloader.kv_caches.tensors:
        rows = t.tensor
        assert (rows[[0, 1, 2, 3]] == rows[[8, 9, 10, 11]]).all()
        assert not (rows[0] == rows[8 + 1]).all()

{marker}
async def test_own_caches_and_pool(make_offloader, kv_caches):
    kv = kv_caches(layers=3, blocks=16, kv_heads=2, head_dim=32)
    off = await make_offloader(kv, cpu_blocks=4, eviction_policy="arc")
    await off.store(KEYS, [4, 5, 6, 7])
    assert await off.load_prefix(KEYS, [12, 13, 14, 15]) == 4
    assert kv.blocks_equal([4, 5, 6, 7], [12, 13, 14, 15])
    assert off.config.eviction_policy == "arc"
"""

LEAKY = """
from aiokvo import make_offload_key

KEYS = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]

async def test_forgets_its_lease(offloader):
    await offloader.store(KEYS, [0, 1])
    lease = offloader.pin_prefix(KEYS)
    assert lease is not None and lease.count == 2   # never released

async def test_next_one_is_clean(make_offloader):
    off = await make_offloader(cpu_blocks=2)
    await off.store(KEYS, [0, 1])
"""


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_a_users_suite_gets_open_offloaders(pytester: pytest.Pytester, mode: str) -> None:
    pytester.makeini(INI.format(mode=mode))
    marker = "@pytest.mark.asyncio" if mode == "strict" else ""
    pytester.makepyfile(ROUND_TRIP.format(marker=marker))
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)


def test_a_lease_never_released_fails_the_test_that_left_it(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI.format(mode="auto"))
    pytester.makepyfile(LEAKY)
    result = pytester.runpytest()
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_forgets_its_lease*",
        "*Offloader 0: 1 leases from pin_prefix never released*",
        "*Offloader 0: 2 pool blocks still pinned by loads*",
    ])


@pytest.mark.system
def test_without_pytest_asyncio_the_fixtures_say_what_to_install(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    shadow = pytester.mkdir("shadow")  # a pytest_asyncio that cannot be imported
    (shadow / "pytest_asyncio.py").write_text("raise ImportError('not installed')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    pytester.makeini("[pytest]\n")
    pytester.makepyfile("def test_uses_it(offloader):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:asyncio")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*the offloader fixture needs pytest-asyncio*aiokvo[[]testing[]]*"]
    )


async def test_the_leak_check_sees_a_reservation_never_completed() -> None:
    factory = OffloaderFactory()
    off = await factory(make_kv_caches(blocks=8, kv_heads=1, head_dim=16), cpu_blocks=4)
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(3)]
    assert offloader_leaks(off) == []
    out = off.manager.prepare_store(keys, ReqContext())  # by hand, never completed
    assert out is not None and len(out.keys_to_store) == 3
    assert offloader_leaks(off) == [
        "3 pool blocks still reserved by stores that never completed"
    ]
    with pytest.raises(AssertionError, match="Offloader 0: 3 pool blocks still reserved"):
        await factory.aclose()
    assert off.closed and factory.made == ()


async def test_a_clean_offloader_closes_quietly() -> None:
    factory = OffloaderFactory()
    off = await factory(make_kv_caches(blocks=8, kv_heads=1, head_dim=16), cpu_blocks=4)
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]
    assert (await off.store(keys, [0, 1])).stored
    async with off.pin_prefix(keys) as lease:  # type: ignore[union-attr]
        assert await lease.load_into([2, 3]) == 2
    await factory.aclose()
    assert off.closed


def test_offload_config_takes_the_geometry_from_the_caches() -> None:
    kv = make_kv_caches(layers=2, blocks=4, block_size=32, kv_heads=1, head_dim=8)
    config = offload_config(kv, cpu_blocks=3, eviction_policy="arc")
    assert config.num_cpu_blocks == 3
    assert config.kv_bytes_per_block == kv.canonical.page_bytes_per_block
    assert config.gpu_block_sizes == (32,) and config.eviction_policy == "arc"
    with pytest.raises(ConfigError, match="cpu_blocks"):
        offload_config(kv, cpu_blocks=0)
    with pytest.raises(ConfigError, match="KVCaches"):
        offload_config(kv.canonical, cpu_blocks=1)  # type: ignore[arg-type]


async def test_config_and_options_together_are_refused_before_anything_opens() -> None:
    factory = OffloaderFactory()
    kv = make_kv_caches(blocks=4, kv_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match="eviction_policy"):
        await factory(kv, config=offload_config(kv), eviction_policy="arc")
    assert factory.made == ()
