"""The counters every tier's core keeps, the snapshot they fill, and the core's one gate."""

from __future__ import annotations

from dataclasses import fields

import pytest

from aiokvo.keys import make_offload_key
from aiokvo.tiers.base import TierStatistics
from aiokvo.tiers.core import TierCore
from aiokvo.tiers.counters import COUNTER_FIELDS, TierCounters
from aiokvo.tiers.disk.spec import DiskLoadStoreSpec
from aiokvo.tiers.mooncake.spec import MooncakeLoadStoreSpec
from aiokvo.tiers.mooncake.store import MooncakeTierStatistics
from aiokvo.tiers.seen_index import SeenIndex
from aiokvo.tiers.settings import TierSettings
from aiokvo.tiers.slot_index import SlotIndex

# Fields a snapshot reads from their owner (index, breaker, connection), not counters.
_READ_FROM_OWNERS = {
    "medium", "capacity_blocks", "used_blocks", "capacity_bytes", "used_bytes", "connected",
    "evictions", "removals", "failure_causes", "breaker",
}  # fmt: skip


def test_every_counter_is_a_statistics_field_and_reported_as_counted() -> None:
    names = [f.name for f in fields(TierStatistics)]
    assert set(COUNTER_FIELDS) <= set(names) and len(set(COUNTER_FIELDS)) == len(COUNTER_FIELDS)
    # Derived from the snapshot: every field not read from an owner is a counter, in order.
    assert list(COUNTER_FIELDS) == [n for n in names if n not in _READ_FROM_OWNERS]
    counters = TierCounters()
    assert counters.counters() == dict.fromkeys(COUNTER_FIELDS, 0)
    floats = {f.name for f in fields(TierStatistics) if f.type in ("float", float)}
    assert floats == {"read_seconds", "write_seconds"}
    assert all(isinstance(getattr(counters, n), float) for n in floats)
    for n, name in enumerate(COUNTER_FIELDS, 1):
        setattr(counters, name, getattr(counters, name) + n)
    snapshot = TierStatistics(medium="X", **counters.counters())
    assert [getattr(snapshot, name) for name in COUNTER_FIELDS] == list(
        range(1, len(COUNTER_FIELDS) + 1)
    )


def _settings() -> TierSettings:
    return TierSettings(model_id="m", failure_threshold=1, reset_after=1.0)


def _cores() -> list[TierCore]:
    disk = TierCore(SlotIndex(4, medium="DISK"), _settings(), spec_class=DiskLoadStoreSpec)
    mooncake = TierCore(
        SeenIndex(lambda key: bytes(key).hex(), medium="MOONCAKE"), _settings(),
        spec_class=MooncakeLoadStoreSpec, probes=True,
    )  # fmt: skip
    return [disk, mooncake]


def test_both_tier_indexes_count_with_the_shared_counters() -> None:
    for core in _cores():
        assert isinstance(core, TierCounters)
        assert core.counters() == dict.fromkeys(COUNTER_FIELDS, 0)
        assert core.checksum_failures == core.stale_reads == core.store_failures == 0
        assert core.remote_lookups == core.connects == 0


@pytest.mark.parametrize("core", _cores(), ids=["disk", "mooncake"])
def test_the_one_gate_turns_every_operation_away_and_counts_each_once(core: TierCore) -> None:
    """Whatever the tier, an open breaker turns away lookups, offers, reads and writes,
    each one ``rejected`` (the disk tier's offer counted one and Mooncake's did not)."""
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(2)]
    core.breaker.record_failure(0.0)  # failure_threshold=1: open until 1.0
    assert not core.usable(0.5)
    assert core.lookup(keys, 0.5) == 0
    assert core.offer(keys, 0.5) == []
    assert core.prepare_read(keys, 0.5) is None
    assert core.prepare_write(keys, 0.5) is None
    assert core.breaker.statistics(0.5).rejected == 4
    assert core.lookups == core.lookups_bypassed == 1
    assert core.offers == 2 and core.writes_refused == 4  # the offer's two, the write's two
    assert core.admitted == core.reads == core.writes == 0


def test_mooncake_statistics_read_its_causes_and_connections_from_the_shared_fields() -> None:
    causes = {
        "not_found": 1, "lease_expired": 2, "transfer_failed": 3, "size_mismatch": 4,
        "bad_trailer": 5, "pool_full": 6,
    }  # fmt: skip
    stats = MooncakeTierStatistics(
        medium="MOONCAKE", connects=7, connect_failures=8, store_failures=9,
        failure_causes=causes,
    )  # fmt: skip
    assert (stats.setups, stats.setup_failures, stats.rpc_failures) == (7, 8, 9)
    assert [
        stats.not_found, stats.lease_expired, stats.transfer_failed, stats.size_mismatches,
        stats.bad_trailers, stats.pool_full,
    ] == [1, 2, 3, 4, 5, 6]  # fmt: skip
    assert MooncakeTierStatistics(medium="MOONCAKE").not_found == 0


@pytest.mark.parametrize("which", [0, 1], ids=["disk", "mooncake"])
@pytest.mark.parametrize("way", ["read", "write"])
def test_a_job_that_saw_its_deadline_first_is_one_timeout(which: int, way: str) -> None:
    """A job started after its deadline marks its blocks TIMEOUT and ends before the
    loop's timer fires: it is a timeout (not a store failure), counted once whichever
    side saw it first."""
    from aiokvo.errors import TierTimeoutError
    from aiokvo.tiers.outcome import Outcome

    core = _cores()[which]
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(2)]
    if way == "read":
        store = core.prepare_write(keys, 0.0)
        assert store is not None
        for i in range(len(keys)):
            store.spec.outcomes.ok(i)  # type: ignore[attr-defined]
        core.complete_write(store, error=None, now=0.0)
        job: object = core.prepare_read(keys, 0.0)
    else:
        job = core.prepare_write(keys, 0.0)
    assert job is not None
    spec = job.spec  # type: ignore[attr-defined]
    spec.outcomes.fail_rest(Outcome.TIMEOUT, TierTimeoutError("started past its deadline"))
    if way == "read":
        core.complete_read(job, error=None, now=0.1)  # type: ignore[arg-type]
    else:
        core.complete_write(job, error=None, now=0.1)  # type: ignore[arg-type]
    assert (core.timeouts, core.store_failures) == (1, 0)
    core.note_timeout(job.state, 0.2)  # type: ignore[attr-defined]  # the timer, late
    assert core.timeouts == 1
    assert core.breaker.statistics(0.2).failures == 1
