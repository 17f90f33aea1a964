"""Offload keys: a block hash and a KV-cache group index packed into ``bytes``.

A key is plain ``bytes`` rather than a tuple so that millions of them cost
one small immutable object each, hash quickly and are never tracked by the
cyclic garbage collector.

This module also holds the checks every manager entry point shares: a list
of keys must be a list (a bare key would be iterated byte by byte, as ints),
and each key must be ``bytes`` longer than its 4-byte group suffix and at
most :data:`MAX_KEY_BYTES` long (what every tier can store: a disk tier's
index entry has that much room). Both are cheap enough for the hot path
(see docs/manager.md, "Checking keys").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NewType

from aiokvo._util import check_int
from aiokvo.errors import InvalidKeyError

__all__ = [
    "GROUP_IDX_BYTES",
    "MAX_BLOCK_HASH_BYTES",
    "MAX_KEY_BYTES",
    "OffloadKey",
    "bad_key_error",
    "check_keys",
    "describe_key",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "is_offload_key",
    "key_sequence",
    "make_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)
"""``block_hash`` followed by the group index as 4 big-endian bytes."""

GROUP_IDX_BYTES = 4
MAX_KEY_BYTES = 96
"""The longest key (block hash and group index) every tier can store: a block hash
of up to 92 bytes, far more than any hash a serving engine uses (32)."""
MAX_BLOCK_HASH_BYTES = MAX_KEY_BYTES - GROUP_IDX_BYTES
_MAX_GROUP_IDX = (1 << (8 * GROUP_IDX_BYTES)) - 1
_HASH_SHOWN = 6  # bytes of the hash an error message shows
_BARE = (bytes, bytearray, memoryview, str)


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack ``block_hash`` (1 to 92 bytes) and ``group_idx`` (0 .. 2**32-1) into a key."""
    if not isinstance(block_hash, (bytes, bytearray, memoryview)) or not len(block_hash):
        raise InvalidKeyError(f"block_hash must be non-empty bytes, got {block_hash!r}")
    if len(block_hash) > MAX_BLOCK_HASH_BYTES:
        raise InvalidKeyError(
            f"block_hash is {len(block_hash)} bytes; at most {MAX_BLOCK_HASH_BYTES} fit every "
            "tier (hash it down, e.g. with hashlib.blake2b(..., digest_size=32))"
        )
    group_idx = check_int("group_idx", group_idx, minimum=0, maximum=_MAX_GROUP_IDX,
                          error=InvalidKeyError)
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_IDX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """Return the block hash part of ``key``."""
    _check_key(key)
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """Return the KV-cache group index stored in ``key``."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def is_offload_key(value: object) -> bool:
    """True for ``bytes`` longer than the group suffix (a hash of at least one byte) and
    at most :data:`MAX_KEY_BYTES`."""
    return isinstance(value, bytes) and GROUP_IDX_BYTES < len(value) <= MAX_KEY_BYTES


def describe_key(value: object) -> str:
    """``value`` for an error message: a key as its hash in short hex and its group.

    A raw 36-byte key printed with ``repr`` is ~150 unreadable characters;
    ``OffloadKey(9f86d081884c…, group 0)`` is enough to tell keys apart in a
    log. Anything that is not a key is shown by a shortened ``repr``.
    """
    if is_offload_key(value):
        assert isinstance(value, bytes)
        block_hash = value[:-GROUP_IDX_BYTES]
        shown = block_hash[:_HASH_SHOWN].hex() + ("…" if len(block_hash) > _HASH_SHOWN else "")
        group = int.from_bytes(value[-GROUP_IDX_BYTES:], "big")
        return f"OffloadKey({shown}, group {group})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def key_sequence(keys: Iterable[OffloadKey], what: str) -> Sequence[OffloadKey]:
    """``keys`` as a list or tuple, refusing a bare key (or any ``bytes``/``str``).

    A ``bytes`` object is itself iterable, as ints: ``prepare_store(key)``
    would store 36 ints and evict real blocks for them. Lists and tuples
    pass through with one type test; other iterables are listed.
    """
    kind = type(keys)
    if kind is list or kind is tuple:
        return keys  # type: ignore[return-value]
    if isinstance(keys, _BARE):
        raise InvalidKeyError(
            f"{what} takes a list of keys, got a bare {kind.__name__} {describe_key(keys)}: "
            f"pass [key]"
        )
    try:
        return list(keys)
    except TypeError:
        raise InvalidKeyError(
            f"{what} takes a list of keys, got {describe_key(keys)}"
        ) from None


def check_keys(keys: Iterable[object], what: str) -> None:
    """Raise :class:`InvalidKeyError` naming the first element that is not an OffloadKey.

    One type test and one length per key (a bytes subclass takes the slow path).
    """
    for key in keys:
        # The exact type test is the fast path; a bytes subclass passes the second.
        if (type(key) is not bytes or not GROUP_IDX_BYTES < len(key) <= MAX_KEY_BYTES) and (
            not is_offload_key(key)
        ):
            raise bad_key_error(key, what)


def bad_key_error(value: object, what: str) -> InvalidKeyError:
    """The error for one ``value`` that is not an OffloadKey, passed to ``what``."""
    return InvalidKeyError(
        f"{what}: {describe_key(value)} is not an OffloadKey "
        f"(bytes: a block hash, then a {GROUP_IDX_BYTES}-byte group index; "
        f"{MAX_KEY_BYTES} bytes at most)"
    )


def _check_key(key: bytes) -> None:
    if not is_offload_key(key):
        raise bad_key_error(key, "expected an OffloadKey")
