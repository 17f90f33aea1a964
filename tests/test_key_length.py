"""A key every tier can store, or an error where it is made (issue: a 100-byte hash was
accepted by make_offload_key and the CPU pool, then silently never written to disk)."""

from __future__ import annotations

import pytest

from aiokvo import ReqContext, make_offload_key
from aiokvo.errors import InvalidKeyError
from aiokvo.keys import MAX_BLOCK_HASH_BYTES, MAX_KEY_BYTES
from aiokvo.manager import CPUOffloadingManager


def test_a_block_hash_too_long_for_the_tiers_is_refused_where_the_key_is_made() -> None:
    assert len(make_offload_key(b"h" * MAX_BLOCK_HASH_BYTES, 3)) == MAX_KEY_BYTES
    with pytest.raises(InvalidKeyError, match=f"{MAX_BLOCK_HASH_BYTES + 1} bytes"):
        make_offload_key(b"h" * (MAX_BLOCK_HASH_BYTES + 1), 0)


@pytest.mark.parametrize("call", ["lookup", "prepare_store", "lookup_prefix"])
def test_the_manager_refuses_a_key_longer_than_every_tier_takes(call: str) -> None:
    manager = CPUOffloadingManager(4)
    long_key = b"x" * (MAX_KEY_BYTES + 1)
    with pytest.raises(InvalidKeyError, match="96 bytes at most"):
        if call == "lookup":
            manager.lookup(long_key, ReqContext())  # type: ignore[arg-type]
        elif call == "prepare_store":
            manager.prepare_store([long_key], ReqContext())  # type: ignore[list-item]
        else:
            manager.lookup_prefix([long_key], ReqContext())  # type: ignore[list-item]
    assert manager.statistics().used_blocks == 0  # refused before any state changed
