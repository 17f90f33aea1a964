"""The Mooncake tier's pure core (a SeenIndex under a TierCore): lookups, per-block
outcomes, caches, breaker, events.

Driven with a fake clock and hand-filled outcomes, the way the store fills them
(each failed block with Mooncake's cause).
"""

from __future__ import annotations

from typing import Any

import pytest

from aiokvo.manager.sink import EventSink
from aiokvo.specs import OffloadingEvent
from aiokvo.tiers.base import TierLoad, TierStore
from aiokvo.tiers.core import TierCore
from aiokvo.tiers.mooncake.spec import MooncakeLoadStoreSpec
from aiokvo.tiers.outcome import Outcome
from aiokvo.tiers.seen_index import SeenIndex
from aiokvo.tiers.settings import TierSettings
from tests.offloader._harness import keys

Status = tuple[Outcome, str | None]
OK: Status = (Outcome.OK, None)
GONE: Status = (Outcome.MISSING, "not_found")
CORRUPT: Status = (Outcome.CORRUPT, "checksum")
LEASE_EXPIRED: Status = (Outcome.STALE, "lease_expired")
TRANSFER_FAILED: Status = (Outcome.MISSING, "transfer_failed")
SIZE_MISMATCH: Status = (Outcome.CORRUPT, "size_mismatch")
BAD_TRAILER: Status = (Outcome.CORRUPT, "bad_trailer")
NO_SPACE: Status = (Outcome.MISSING, "pool_full")
RPC_FAILED: Status = (Outcome.IO_ERROR, "rpc_failed")
TIMEOUT: Status = (Outcome.TIMEOUT, None)

_INDEX_OPTIONS = ("max_tracked", "negative_ttl", "index_ttl")


def make(**options: Any) -> tuple[TierCore, EventSink]:
    """A core over a SeenIndex; ``options`` are the settings' and the index's."""
    sink = EventSink(record=True)
    index_options = {k: options[k] for k in _INDEX_OPTIONS if k in options}
    options.pop("negative_ttl", None)
    options.pop("index_ttl", None)
    options.setdefault("failure_threshold", 2)
    options.setdefault("reset_after", 1.0)
    index = SeenIndex(lambda k: f"ns/{k.hex()}", medium="MOONCAKE", sink=sink, **index_options)
    state = TierCore(
        index, TierSettings(model_id="m", **options), spec_class=MooncakeLoadStoreSpec,
        probes=True, connected=False,
    )  # fmt: skip
    state.set_connected(True, 0.0)
    return state, sink


def seen(state: TierCore) -> SeenIndex:
    index = state.index
    assert isinstance(index, SeenIndex)
    return index


def finish(spec_of: TierLoad | TierStore, *statuses: Status) -> None:
    spec = spec_of.spec
    assert isinstance(spec, MooncakeLoadStoreSpec)
    assert len(statuses) == len(spec)
    for i, (outcome, cause) in enumerate(statuses):
        if outcome is Outcome.OK:
            spec.outcomes.ok(i)
        else:
            spec.outcomes.fail(i, outcome, RuntimeError(cause), cause)


def test_lookup_asks_the_keys_before_the_first_negative_one_and_counts_hits() -> None:
    state, _ = make()
    ks = keys("a", "b", "c", "d")
    assert state.begin_lookup(ks, 0.0) == ks
    assert state.finish_lookup(ks, ks, [1, 1, 0, 1], 0.0) == 2
    assert (state.lookups, state.lookup_hits, state.lookup_misses) == (1, 2, 1)
    # A read shows "b" vanished: the next lookups stop before it without asking.
    load = state.prepare_read(ks[:2], 0.0)
    assert load is not None
    finish(load, OK, GONE)
    assert state.complete_read(load, error=None, now=0.0) == ks[:1]
    assert state.begin_lookup(ks, 1.0) == ks[:1]
    assert seen(state).negative_hits == 1
    # Until the negative entry expires.
    assert state.begin_lookup(ks, 10.0 + 0.001) == ks
    assert seen(state).negative(10.001) == 0


def test_lookup_is_bypassed_while_disconnected_or_the_breaker_is_open() -> None:
    state, _ = make()
    ks = keys("a")
    state.set_connected(False, 0.0)
    assert state.begin_lookup(ks, 0.0) is None
    state.set_connected(True, 0.0)
    state.record_lookup_call(False, 0.0)
    state.record_lookup_call(False, 0.0)  # threshold 2: open
    assert not state.usable(0.5)
    assert state.begin_lookup(ks, 0.5) is None
    assert state.lookups_bypassed == 2
    assert state.prepare_read(ks, 0.5) is None
    assert state.offer(ks, 0.5) == []
    # Half-open after reset_after: the tier's own probe is due, callers still bypass.
    assert state.needs_probe(1.5) and not state.usable(1.5)
    assert state.breaker.acquire(1.5)
    state.record_probe(True, 1.6)
    assert state.usable(1.6)


def test_each_block_of_a_read_is_its_own_outcome() -> None:
    state, sink = make()
    ks = keys("ok", "gone", "late", "dead", "short", "foreign", "corrupt")
    statuses = (OK, GONE, LEASE_EXPIRED, TRANSFER_FAILED, SIZE_MISMATCH, BAD_TRAILER, CORRUPT)
    load = state.prepare_read(ks, 0.0)
    assert load is not None
    finish(load, *statuses)
    assert state.complete_read(load, error=None, now=0.0, nbytes=10) == ks[:1]
    assert state.read_failures == 6 and state.blocks_read == 1 and state.bytes_read == 10
    # Stale "exists" answers are remembered; a lease that ran out is not (the object is there).
    negative = {k for k in ks if seen(state).is_negative(k, 0.0)}
    assert negative == {ks[1], ks[3], ks[4], ks[5], ks[6]}
    # Wrong bytes under our name are removed from the cluster, once (an object of the
    # wrong size is CORRUPT too now, so it is removed as well).
    assert state.index.take_removals() == [f"ns/{ks[i].hex()}" for i in (4, 5, 6)]
    assert state.index.take_removals() == []
    assert state.causes["checksum"] == 1 and state.causes["not_found"] == 1
    assert state.checksum_failures == 3  # every CORRUPT read: size, trailer, checksum
    # Per-key misses are not the cluster failing: the breaker stays closed.
    assert state.breaker.statistics(0.0).consecutive_failures == 0
    assert sink.take() == []  # none of these was announced by this tier


def test_a_failed_call_counts_against_the_breaker_and_a_trip_forgets_freshness() -> None:
    state, _ = make()
    ks = keys("a", "b")
    store = state.prepare_write(ks, 0.0)
    assert store is not None
    finish(store, OK, OK)
    state.complete_write(store, error=None, now=0.0)
    assert seen(state).is_fresh(ks[0], 1.0)
    for _ in range(2):
        load = state.prepare_read(ks, 1.0)
        assert load is not None
        finish(load, RPC_FAILED, RPC_FAILED)
        state.complete_read(load, error=None, now=1.0)
    assert state.breaker.statistics(1.0).state == "open"
    assert state.store_failures == 2
    assert not seen(state).is_fresh(ks[0], 1.0)  # the cluster may have lost everything
    assert not seen(state).is_negative(ks[0], 1.0)  # but a failed call says nothing of a key


def test_writes_skip_keys_in_flight_seen_recently_or_negative() -> None:
    state, sink = make(index_ttl=5.0)
    a, b, c, d = keys("a", "b", "c", "d")
    assert state.offer([a, b, c], 0.0) == [a, b, c]
    store = state.prepare_write([a, b], 0.0)
    assert store is not None and store.keys == [a, b]
    assert state.prepare_write([a, b], 0.0) is None  # in flight
    assert state.offer([a, c], 0.0) == [c]
    finish(store, OK, NO_SPACE)
    assert state.complete_write(store, error=None, now=1.0) == [a]
    assert state.blocks_written == 1 and state.write_failures == 1
    assert state.causes["pool_full"] == 1
    assert sink.take() == [OffloadingEvent([a], "MOONCAKE", False)]
    assert state.offer([a, b], 2.0) == [b]  # a was just written; b failed: again
    assert state.offer([a], 6.1) == [a]  # not seen for index_ttl: write again
    load = state.prepare_read([d], 6.1)
    assert load is not None
    finish(load, GONE)
    state.complete_read(load, error=None, now=6.1)
    assert state.offer([d], 6.2) == []  # its get just failed: not for negative_ttl


def test_a_block_we_announced_is_announced_gone_once_a_read_shows_it() -> None:
    state, sink = make()
    a, b = keys("a", "b")
    store = state.prepare_write([a], 0.0)
    assert store is not None
    finish(store, OK)
    state.complete_write(store, error=None, now=0.0)
    sink.take()
    load = state.prepare_read([a, b], 1.0)
    assert load is not None
    finish(load, GONE, GONE)
    state.complete_read(load, error=None, now=1.0)
    assert sink.take() == [OffloadingEvent([a], "MOONCAKE", True)]
    assert seen(state).used_blocks == 0


def test_admission_holds_a_key_back_until_its_nth_offer() -> None:
    state, _ = make(admit_after=2)
    (a,) = keys("a")
    assert state.offer([a], 0.0) == []
    assert state.offer([a], 0.0) == [a]
    assert (state.offers, state.admitted) == (2, 1)


def test_a_timeout_counts_once_and_a_late_outcome_changes_nothing() -> None:
    state, _ = make()
    ks = keys("a")
    load = state.prepare_read(ks, 0.0)
    assert load is not None
    state.note_timeout(load.state, 0.0)
    state.note_timeout(load.state, 0.0)
    assert state.timeouts == 1
    assert state.breaker.statistics(0.0).consecutive_failures == 1
    finish(load, OK)
    assert state.complete_read(load, error=None, now=0.1) == ks  # its bytes are still good
    assert state.breaker.statistics(0.1).consecutive_failures == 1


def test_the_index_and_the_negative_cache_are_bounded() -> None:
    state, _ = make(max_tracked=3)
    ks = keys(*"abcdef")
    state.finish_lookup(ks, ks, [1] * 6, 0.0)
    assert seen(state).used_blocks == 3
    assert [seen(state).is_fresh(k, 0.0) for k in ks] == [False] * 3 + [True] * 3
    load = state.prepare_read(ks, 0.0)
    assert load is not None
    finish(load, *[GONE] * 6)
    state.complete_read(load, error=None, now=0.0)
    assert seen(state).negative(0.0) == 3


@pytest.mark.parametrize("status", [RPC_FAILED, TIMEOUT])
def test_a_write_whose_call_failed_opens_the_breaker(status: Status) -> None:
    state, _ = make()
    for name in ("a", "b"):
        store = state.prepare_write(keys(name), 0.0)
        assert store is not None
        finish(store, status)
        state.complete_write(store, error=None, now=0.0)
    assert state.breaker.statistics(0.0).state == "open"
    assert state.prepare_write(keys("c"), 0.0) is None
    assert state.writes_refused == 1


@pytest.mark.system
def test_the_pure_parts_import_without_asyncio_torch_or_mooncake() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import aiokvo.tiers.mooncake, aiokvo.tiers.mooncake.spec, aiokvo.tiers.seen_index\n"
        "import aiokvo.tiers.mooncake.config, aiokvo.tiers.mooncake.format, aiokvo.tiers.core\n"
        "bad = [m for m in ('asyncio', 'torch', 'mooncake') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
