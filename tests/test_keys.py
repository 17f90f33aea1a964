"""Offload keys: packing, unpacking, and how error messages show them."""

from __future__ import annotations

import pytest

from aiokvo.errors import InvalidKeyError
from aiokvo.keys import (
    describe_key,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)


def test_a_key_is_the_hash_then_the_group_big_endian() -> None:
    key = make_offload_key(b"\xab" * 32, 258)
    assert key == b"\xab" * 32 + b"\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\xab" * 32
    assert get_offload_group_idx(key) == 258


@pytest.mark.parametrize(
    ("block_hash", "group"),
    [(b"", 0), (5, 0), ("text", 0), (b"h", -1), (b"h", 1 << 32), (b"h", 2.0), (b"h", True)],
)
def test_bad_parts_are_refused(block_hash: object, group: object) -> None:
    with pytest.raises(InvalidKeyError):
        make_offload_key(block_hash, group)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [b"", b"\x00\x00\x00\x00", "a str"])
def test_splitting_something_that_is_not_a_key_is_refused(value: bytes) -> None:
    with pytest.raises(InvalidKeyError, match="is not an OffloadKey"):
        get_offload_group_idx(value)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError, match="is not an OffloadKey"):
        get_offload_block_hash(value)  # type: ignore[arg-type]


def test_describe_key_shows_a_short_hash_and_the_group() -> None:
    assert describe_key(make_offload_key(bytes(range(32)), 3)) == (
        "OffloadKey(000102030405…, group 3)"
    )
    assert describe_key(make_offload_key(b"ab", 0)) == "OffloadKey(6162, group 0)"
    assert describe_key(7) == "7"
    assert describe_key(b"ab") == "b'ab'"
    long = describe_key("x" * 200)
    assert len(long) == 60 and long.endswith("...")
