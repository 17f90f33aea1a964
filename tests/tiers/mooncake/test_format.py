"""The object format: names, the 64-byte trailer, and what Mooncake's codes mean."""

from __future__ import annotations

import struct

import pytest

from aiokvo.tiers.checksum import xxh3
from aiokvo.tiers.mooncake.format import (
    TRAILER_BYTES,
    check_trailer,
    object_name,
    outcome_of_code,
    pack_trailer,
)
from aiokvo.tiers.outcome import Outcome
from tests.offloader._harness import key

LAYOUT = bytes(range(16))


def test_names_carry_the_prefix_the_layout_and_the_key() -> None:
    k = key("a", group=3)
    assert object_name("team/prod", "v1-abc", k) == f"team/prod/v1-abc/{k.hex()}"
    assert k.hex().endswith("00000003")


def test_a_trailer_vouches_for_its_key_layout_and_length_only() -> None:
    k = key("a")
    trailer = pack_trailer(LAYOUT, k, 4096, 0x1234)
    assert len(trailer) == TRAILER_BYTES
    assert check_trailer(trailer, LAYOUT, k, 4096) == 0x1234
    assert check_trailer(trailer, bytes(16), k, 4096) is None  # another layout
    assert check_trailer(trailer, LAYOUT, key("b"), 4096) is None  # another key
    assert check_trailer(trailer, LAYOUT, k, 4095) is None  # another length
    assert check_trailer(trailer[:-1], LAYOUT, k, 4096) is None  # torn
    assert check_trailer(bytes(TRAILER_BYTES), LAYOUT, k, 4096) is None  # never written


@pytest.mark.parametrize("offset", [0, 8, 24, 32, 40, 48, 56])
def test_any_flipped_byte_breaks_the_seal(offset: int) -> None:
    k = key("a")
    trailer = bytearray(pack_trailer(LAYOUT, k, 64, 99))
    trailer[offset] ^= 1
    assert check_trailer(trailer, LAYOUT, k, 64) is None


def test_a_resealed_forgery_with_another_checksum_is_read_as_that_checksum() -> None:
    # The seal guards against torn and random damage; the payload checksum does the rest.
    k = key("a")
    good = pack_trailer(LAYOUT, k, 64, 1)
    other = pack_trailer(LAYOUT, k, 64, 2)
    assert struct.unpack_from("<Q", good, 40) != struct.unpack_from("<Q", other, 40)
    assert check_trailer(other, LAYOUT, k, 64) == 2


def test_the_payload_checksum_covers_every_buffer_in_order() -> None:
    a, b = b"x" * 100, b"y" * 50
    assert xxh3([a, b]) == xxh3([a + b])
    assert xxh3([a, b]) != xxh3([b, a])


@pytest.mark.parametrize(
    ("code", "outcome", "cause"),
    [
        (-200, Outcome.MISSING, "pool_full"),
        (-600, Outcome.CORRUPT, "size_mismatch"),
        (-704, Outcome.MISSING, "not_found"),
        (-707, Outcome.STALE, "lease_expired"),
        (-800, Outcome.MISSING, "transfer_failed"),
        (-900, Outcome.IO_ERROR, "rpc_failed"),
        (-901, Outcome.IO_ERROR, "rpc_failed"),
        (-1, Outcome.IO_ERROR, "rpc_failed"),
        (-12345, Outcome.IO_ERROR, "error"),  # an unknown code: the store failing
    ],
)
def test_mooncake_codes_map_to_block_outcomes(code: int, outcome: Outcome, cause: str) -> None:
    assert outcome_of_code(code) == (outcome, cause)


def test_many_trailers_at_once_are_the_same_bytes_and_the_same_verdicts() -> None:
    import numpy as np

    from aiokvo.tiers.mooncake.format import key_digest, open_trailers, seal_trailers

    ks = [key(f"k{i}") for i in range(5)]
    lengths, sums = [64, 128, 64, 4096, 1], [1, 2**64 - 1, 0, 12345, 99]
    raw = seal_trailers(LAYOUT, [key_digest(k) for k in ks], lengths, sums)
    assert raw.shape == (5, TRAILER_BYTES) and raw.dtype == np.uint8
    for i, k in enumerate(ks):
        assert raw[i].tobytes() == pack_trailer(LAYOUT, k, lengths[i], sums[i])
    damaged = raw.copy()
    damaged[1, 30] ^= 1  # the key hash
    damaged[3, 60] ^= 1  # the seal
    ok, stored = open_trailers(damaged, LAYOUT, [key_digest(k) for k in ks], lengths)
    assert ok.tolist() == [True, False, True, False, True]
    assert [int(x) for x in stored[[0, 2, 4]]] == [1, 0, 99]
    verdicts = [check_trailer(damaged[i].tobytes(), LAYOUT, k, lengths[i]) is not None
                for i, k in enumerate(ks)]  # fmt: skip
    assert verdicts == ok.tolist()
    ok, _ = open_trailers(raw, bytes(16), [key_digest(k) for k in ks], lengths)
    assert not ok.any()  # another layout
