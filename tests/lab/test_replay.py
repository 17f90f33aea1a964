"""The replay driver: the hit measure on worked examples, refusals, and tiers below."""

from __future__ import annotations

import pytest

from aiokvo.errors import ConfigError
from aiokvo.lab.replay import TierModel, capacity_blocks, replay
from aiokvo.lab.trace import parse_trace
from aiokvo.manager.policies import BUILTIN_POLICIES
from tests.lab._traces import conversation_trace


def keys_of(requests: list[list[int]]) -> tuple[tuple[bytes, ...], ...]:
    trace = parse_trace([f'{{"hash_ids": {ids}}}' for ids in requests])
    return trace.keys


def test_lru_hits_only_the_longest_cached_prefix() -> None:
    # Room for 3. After 1,2,3 then 1,2,4 the pool holds 1,2,4 (3 was least recent),
    # so the third request hits 1,2 and stops at 3, though nothing after it is missing.
    result = replay(keys_of([[1, 2, 3], [1, 2, 4], [1, 2, 3]]), "lru", 3)
    assert (result.hits, result.references, result.requests) == (4, 9, 3)
    assert result.hit_rate == pytest.approx(4 / 9)
    assert (result.blocks_stored, result.blocks_evicted, result.stores_refused) == (5, 2, 0)


def test_a_request_larger_than_the_pool_is_refused_and_the_replay_goes_on() -> None:
    result = replay(keys_of([[1, 2, 3], [1], [1]]), "chain", 2)
    assert result.stores_refused == 1
    assert result.hits == 1  # [1] stored by the second request, hit by the third


@pytest.mark.parametrize("policy", sorted(BUILTIN_POLICIES))
def test_every_policy_replays_and_hits_what_repeats(policy: str) -> None:
    requests = conversation_trace(3, 200)
    result = replay(keys_of(requests), policy, 10_000)  # room for everything
    distinct = len({b for r in requests for b in r})
    assert result.hits == result.references - distinct
    assert result.blocks_stored == distinct and result.blocks_evicted == 0


def test_a_tier_below_serves_what_the_pool_evicted() -> None:
    requests = [[1, 2], [3, 4], [1, 2]]
    alone = replay(keys_of(requests), "lru", 2)
    tiered = replay(keys_of(requests), "lru", 2, tiers=[TierModel("DISK", 8)])
    assert alone.hits == tiered.hits == 0  # the pool (2 blocks) lost 1,2 to 3,4
    (disk,) = tiered.tiers
    assert (disk.name, disk.capacity_blocks) == ("DISK", 8)
    assert disk.hits == disk.blocks_read == 2  # 1,2 promoted from the disk tier
    assert disk.blocks_written == 4  # every block the pool newly stored, written once
    assert tiered.blocks_stored == 6  # 1,2 are back in the pool


def test_capacity_blocks_is_a_share_of_the_distinct_blocks() -> None:
    assert capacity_blocks(0.01, 182_790) == 1828
    assert capacity_blocks(1, 7) == 7
    assert capacity_blocks(0.001, 10) == 1  # at least one block
    for bad in (0, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ConfigError, match="capacity fraction"):
            capacity_blocks(bad, 100)  # type: ignore[arg-type]
