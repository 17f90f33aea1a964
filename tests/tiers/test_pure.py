"""The tiers' pure parts: breaker, admission, fingerprint, and imports without asyncio/torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aiokvo.errors import ConfigError
from aiokvo.keys import make_offload_key
from aiokvo.tiers.admission import Admission
from aiokvo.tiers.breaker import CircuitBreaker
from aiokvo.tiers.fingerprint import LayoutFingerprint


def test_breaker_opens_after_failures_in_a_row_and_trials_once() -> None:
    b = CircuitBreaker(failure_threshold=2, reset_after=1.0, max_reset_after=4.0)
    assert b.acquire(0.0)
    b.record_failure(0.0)
    b.record_success(0.1)  # the run of failures ends
    b.record_failure(0.2)
    assert b.state(0.2) == "closed"
    b.record_failure(0.3)
    assert b.state(0.3) == "open" and not b.available(1.2) and not b.acquire(1.2)
    assert b.state(1.3) == "half_open" and b.available(1.3)
    assert b.acquire(1.3)  # the trial
    assert not b.acquire(1.3) and not b.available(1.3)  # only one at a time
    b.record_failure(1.4)  # failed trial: open again, twice as long
    assert b.state(3.3) == "open" and b.state(3.5) == "half_open"
    assert b.acquire(3.5)
    b.record_success(3.6)
    assert b.state(3.6) == "closed" and b.acquire(3.6)
    stats = b.statistics(3.6)
    assert stats.trips == 2 and stats.rejected == 2 and stats.failures == 4


def test_breaker_backoff_is_capped() -> None:
    b = CircuitBreaker(failure_threshold=1, reset_after=1.0, max_reset_after=2.0)
    now = 0.0
    b.record_failure(now)
    for _ in range(5):
        now += 2.0
        assert b.acquire(now)
        b.record_failure(now)
    assert b.state(now + 1.9) == "open" and b.state(now + 2.0) == "half_open"


@pytest.mark.parametrize(
    "kwargs",
    [{"failure_threshold": 0}, {"reset_after": 0}, {"reset_after": 5, "max_reset_after": 1}],
)
def test_breaker_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        CircuitBreaker(**kwargs)


def test_admission_counts_offers_and_is_bounded() -> None:
    k = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
    everything = Admission(1)
    assert everything.offer([k[0], k[0], k[1]]) == [k[0], k[1]] and everything.tracked == 0
    twice = Admission(2, max_tracked=2)
    assert twice.offer(k[:2]) == []
    assert twice.offer(k[:2]) == k[:2]
    assert twice.offer([k[2]]) == []  # forgets k[0], the least recently offered
    assert twice.offer([k[1]]) == [k[1]] and twice.offer([k[0]]) == []
    with pytest.raises(ConfigError, match="admit_after"):
        Admission(0)


def _fingerprint(**changes: object) -> LayoutFingerprint:
    base: dict[str, object] = {
        "model_id": "m", "dtype": "bfloat16", "tensor_row_bytes": (4096, 4096),
        "group_refs": (((0, 4096), (1, 4096)),), "block_tokens": (16,),
        "block_size_factor": 1, "rank": 0, "world_size": 2,
    }  # fmt: skip
    base.update(changes)
    return LayoutFingerprint(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"}, {"dtype": "float16"}, {"tensor_row_bytes": (4096, 8192)},
        {"group_refs": (((0, 2048), (1, 4096)),)}, {"block_tokens": (32,)},
        {"block_size_factor": 2}, {"rank": 1}, {"world_size": 4}, {"format_version": 2},
    ],
)  # fmt: skip
def test_every_layout_fact_changes_the_fingerprint(change: dict) -> None:
    ours, theirs = _fingerprint(), _fingerprint(**change)
    assert ours.digest() != theirs.digest() and ours.name() != theirs.name()
    assert ours.digest() == _fingerprint().digest()  # stable


def test_fingerprint_payload_is_the_group_rows() -> None:
    fp = _fingerprint(tensor_row_bytes=(4096, 512, 1024), group_refs=(((0, 4096), (2, 1000)),
                      ((1, 512),)), block_tokens=(16, 16))  # fmt: skip
    assert fp.group_tensors(0) == (0, 2) and fp.payload_bytes(0) == 5120
    assert fp.payload_bytes(1) == 512
    with pytest.raises(ConfigError):
        _fingerprint(model_id="")


@pytest.mark.system
def test_pure_parts_import_without_asyncio_or_torch() -> None:
    code = (
        "import sys\n"
        "import aiokvo.tiers.slot_index, aiokvo.tiers.seen_index, aiokvo.tiers.core\n"
        "import aiokvo.tiers.base, aiokvo.tiers.breaker, aiokvo.tiers.index\n"
        "import aiokvo.tiers.fingerprint, aiokvo.tiers.admission, aiokvo.tiers.disk.config\n"
        "import aiokvo.tiers.disk.runs, aiokvo.tiers.counters, aiokvo.tiers.outcome\n"
        "import aiokvo.tiers.settings, aiokvo.tiers.spec, aiokvo.tiers.disk.spec\n"
        "import aiokvo.tiers.mooncake.config, aiokvo.tiers.mooncake.spec\n"
        "import aiokvo.manager.slots\n"
        "bad = [m for m in ('asyncio', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_outcomes_say_all_good_only_when_every_block_is() -> None:
    from aiokvo.tiers.outcome import Outcome, Outcomes

    out = Outcomes(4)
    assert not out.all_ok() and list(out.failures()) == [(Outcome.NOT_RUN, None)] * 4
    out.ok_all([0, 2, 3])
    assert not out.all_ok() and out.count(Outcome.OK) == 3  # block 1 was never decided
    assert list(out.failures()) == [(Outcome.NOT_RUN, None)]
    out.fail(1, Outcome.CORRUPT, ValueError("bad"), "checksum")
    assert not out.all_ok() and list(out.failures()) == [(Outcome.CORRUPT, "checksum")]
    out.ok(1)
    assert out.all_ok() and list(out.failures()) == [] and out.count(Outcome.OK) == 4
    assert Outcomes(0).all_ok()


def test_the_one_group_key_check_agrees_with_checking_each_key() -> None:
    # PoolRows.groups_of checks a one-group transfer's keys in one C-level pass; it must
    # accept exactly the keys the per-key check accepts as group 0.
    from aiokvo.keys import GROUP_IDX_BYTES, MAX_KEY_BYTES, is_offload_key
    from aiokvo.tiers.store import _all_group_zero

    class Key(bytes):
        pass

    good = make_offload_key(b"h" * 32, 0)
    cases: list[object] = [
        good, Key(good), make_offload_key(b"h" * 32, 1), b"\0" * GROUP_IDX_BYTES,
        b"h" * (MAX_KEY_BYTES - GROUP_IDX_BYTES) + bytes(GROUP_IDX_BYTES),
        b"h" * (MAX_KEY_BYTES + 1 - GROUP_IDX_BYTES) + bytes(GROUP_IDX_BYTES),
        good.decode("latin-1"), bytearray(good), memoryview(good), None,
    ]  # fmt: skip
    for case in cases:
        alone = isinstance(case, bytes) and is_offload_key(case) and case.endswith(
            bytes(GROUP_IDX_BYTES)
        )
        assert _all_group_zero([good, case, good]) is alone, case
    assert _all_group_zero([]) and _all_group_zero([good, Key(good)])
