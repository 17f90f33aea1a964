"""Offload keys: a block hash and a KV-cache group index packed into ``bytes``.

A key is plain ``bytes`` rather than a tuple so that millions of them cost
one small immutable object each, hash quickly and are never tracked by the
cyclic garbage collector.
"""

from __future__ import annotations

from typing import NewType

__all__ = [
    "GROUP_IDX_BYTES",
    "OffloadKey",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)
"""``block_hash`` followed by the group index as 4 big-endian bytes."""

GROUP_IDX_BYTES = 4
_MAX_GROUP_IDX = (1 << (8 * GROUP_IDX_BYTES)) - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack ``block_hash`` and ``group_idx`` (0 .. 2**32-1) into a key."""
    if not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise ValueError(f"group_idx must be in 0..{_MAX_GROUP_IDX}, got {group_idx!r}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_IDX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """Return the block hash part of ``key``."""
    _check_key(key)
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """Return the KV-cache group index stored in ``key``."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def _check_key(key: bytes) -> None:
    if len(key) < GROUP_IDX_BYTES:
        raise ValueError(
            f"an OffloadKey has at least {GROUP_IDX_BYTES} bytes, got {len(key)}: {key!r}"
        )
