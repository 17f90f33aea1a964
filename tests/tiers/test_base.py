"""The counters both tier state machines share, and the snapshot they fill."""

from __future__ import annotations

from dataclasses import fields

from aiokvo.tiers.base import TierStatistics
from aiokvo.tiers.counters import COUNTER_FIELDS, TierCounters
from aiokvo.tiers.disk.state import DiskTierState
from aiokvo.tiers.mooncake.state import MooncakeTierState


def test_every_counter_is_a_statistics_field_and_reported_as_counted() -> None:
    names = {f.name for f in fields(TierStatistics)}
    assert set(COUNTER_FIELDS) <= names and len(set(COUNTER_FIELDS)) == len(COUNTER_FIELDS)
    counters = TierCounters()
    assert counters.counters() == dict.fromkeys(COUNTER_FIELDS, 0)
    for n, name in enumerate(COUNTER_FIELDS, 1):
        setattr(counters, name, getattr(counters, name) + n)
    snapshot = TierStatistics(medium="X", **counters.counters())
    assert [getattr(snapshot, name) for name in COUNTER_FIELDS] == list(
        range(1, len(COUNTER_FIELDS) + 1)
    )


def test_both_tier_states_count_with_the_shared_counters() -> None:
    disk = DiskTierState(4)
    mooncake = MooncakeTierState(lambda key: bytes(key).hex())
    for state in (disk, mooncake):
        assert isinstance(state, TierCounters)
        assert state.counters() == dict.fromkeys(COUNTER_FIELDS, 0)
    assert disk.checksum_failures == disk.stale_reads == 0
    assert mooncake.remote_lookups == mooncake.rpc_failures == 0
