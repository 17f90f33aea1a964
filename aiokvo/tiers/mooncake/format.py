"""How a block lives in a Mooncake cluster: its object name and its trailer (pure).

**Names.** ``<key_prefix>/<fingerprint name>/<key hex>``: the layout
fingerprint (:class:`~aiokvo.tiers.fingerprint.LayoutFingerprint`: model,
dtype, page geometry, block size, rank, format version) is part of every
name, so replicas of one model share their blocks and an incompatible engine
never even asks for them; ``key_prefix`` separates deployments sharing a
cluster.

**Objects.** One object per block, written from and read into the CPU pool
with no staging copy: a full pool row of each canonical tensor the key's
group uses, in order, then a 64-byte trailer (kept in room after the pool
row, or in a small registered arena: the same bytes either way):

=======  =====  ====================================================
offset   bytes  field
=======  =====  ====================================================
0        8      magic ``AIOKVOMC``
8        16     the first 16 bytes of the layout fingerprint's digest
24       8      xxh3-64 of the :class:`~aiokvo.OffloadKey`
32       8      payload bytes (the rows before the trailer)
40       8      xxh3-64 of the payload
48       8      zero (reserved)
56       8      xxh3-64 of bytes 0..56 (the trailer's own seal)
=======  =====  ====================================================

A block read back is good only if Mooncake returned exactly payload + 64
bytes, the trailer is sealed and names this layout, this key and this
length, and the payload hashes to the stored checksum. xxh3 (xxhash)
releases the GIL and runs at about 11-15 GB/s here, several times Mooncake's
TCP throughput.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

try:
    import xxhash
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from aiokvo._util import missing_extra

    raise missing_extra(exc, "the Mooncake tier", "mooncake") from exc

from aiokvo.keys import OffloadKey
from aiokvo.tiers.outcome import Outcome

__all__ = [
    "MAGIC",
    "TRAILER_BYTES",
    "check_trailer",
    "key_digest",
    "object_name",
    "open_trailers",
    "pack_trailer",
    "outcome_of_code",
    "seal_trailers",
]

MAGIC = b"AIOKVOMC"
TRAILER_BYTES = 64
_TRAILER = struct.Struct("<8s16sQQQQQ")
assert _TRAILER.size == TRAILER_BYTES
_SEALED = TRAILER_BYTES - 8


def object_name(prefix: str, namespace: str, key: OffloadKey) -> str:
    """The cluster object holding ``key``'s block."""
    return f"{prefix}/{namespace}/{key.hex()}"


def key_digest(key: OffloadKey) -> int:
    return xxhash.xxh3_64_intdigest(key)


# The same 64 bytes as _TRAILER, as whole little-endian words: many trailers at once.
TRAILER_DTYPE = np.dtype([
    ("magic", "<u8"), ("layout0", "<u8"), ("layout1", "<u8"), ("key", "<u8"),
    ("length", "<u8"), ("checksum", "<u8"), ("zero", "<u8"), ("seal", "<u8"),
])  # fmt: skip
assert TRAILER_DTYPE.itemsize == TRAILER_BYTES
_MAGIC_WORD = int.from_bytes(MAGIC, "little")


def _seals(raw: np.ndarray) -> list[int]:
    data = raw.tobytes()
    seal = xxhash.xxh3_64_intdigest
    return [seal(data[i : i + _SEALED]) for i in range(0, len(data), TRAILER_BYTES)]


def seal_trailers(
    layout: bytes, key_hashes: Sequence[int], lengths: Sequence[int], checksums: Sequence[int]
) -> np.ndarray:
    """The ``(k, 64)`` uint8 trailers of ``k`` blocks (byte for byte :func:`pack_trailer`'s)."""
    t = np.zeros(len(key_hashes), dtype=TRAILER_DTYPE)
    t["magic"] = _MAGIC_WORD
    t["layout0"] = int.from_bytes(layout[:8], "little")
    t["layout1"] = int.from_bytes(layout[8:16], "little")
    t["key"] = np.asarray(key_hashes, dtype=np.uint64)
    t["length"] = np.asarray(lengths, dtype=np.uint64)
    t["checksum"] = np.asarray(checksums, dtype=np.uint64)
    raw = t.view(np.uint8).reshape(len(t), TRAILER_BYTES)
    t["seal"] = np.asarray(_seals(raw), dtype=np.uint64)
    return raw


def open_trailers(
    raw: np.ndarray, layout: bytes, key_hashes: Sequence[int], lengths: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """For ``(k, 64)`` uint8 trailers: which are sealed and name this layout, these keys
    and lengths (a bool mask), and the payload checksums they vouch for."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    t = raw.view(TRAILER_DTYPE).reshape(len(raw))
    ok = (
        (t["magic"] == _MAGIC_WORD)
        & (t["layout0"] == int.from_bytes(layout[:8], "little"))
        & (t["layout1"] == int.from_bytes(layout[8:16], "little"))
        & (t["key"] == np.asarray(key_hashes, dtype=np.uint64))
        & (t["length"] == np.asarray(lengths, dtype=np.uint64))
        & (t["zero"] == 0)
        & (t["seal"] == np.asarray(_seals(raw), dtype=np.uint64))
    )
    return ok, t["checksum"].copy()


def pack_trailer(layout: bytes, key: OffloadKey, payload_bytes: int, checksum: int) -> bytes:
    """The 64-byte trailer of ``key``'s block (``layout``: 16 bytes of the digest)."""
    body = _TRAILER.pack(MAGIC, layout, key_digest(key), payload_bytes, checksum, 0, 0)
    seal = xxhash.xxh3_64_intdigest(body[:_SEALED])
    return body[:_SEALED] + seal.to_bytes(8, "little")


def check_trailer(
    trailer: bytes | bytearray | memoryview, layout: bytes, key: OffloadKey, payload_bytes: int
) -> int | None:
    """The payload checksum ``trailer`` vouches for, or None if it is not
    ``key``'s block of this layout (torn, foreign or corrupt)."""
    raw = bytes(trailer)
    if len(raw) != TRAILER_BYTES:
        return None
    magic, digest, key_hash, length, checksum, reserved, seal = _TRAILER.unpack(raw)
    if (
        magic != MAGIC
        or seal != xxhash.xxh3_64_intdigest(raw[:_SEALED])
        or digest != layout
        or key_hash != key_digest(key)
        or length != payload_bytes
        or reserved != 0
    ):
        return None
    return int(checksum)


# Mooncake's ErrorCode values (mooncake-store/include/types.h) that the tier tells apart.
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
INTERNAL_ERROR = -1

_OUTCOMES: dict[int, tuple[Outcome, str]] = {
    NO_AVAILABLE_HANDLE: (Outcome.MISSING, "pool_full"),
    INVALID_PARAMS: (Outcome.CORRUPT, "size_mismatch"),
    OBJECT_NOT_FOUND: (Outcome.MISSING, "not_found"),
    LEASE_EXPIRED: (Outcome.STALE, "lease_expired"),
    TRANSFER_FAIL: (Outcome.MISSING, "transfer_failed"),
    RPC_FAIL: (Outcome.IO_ERROR, "rpc_failed"),
    RPC_TIMEOUT: (Outcome.IO_ERROR, "rpc_failed"),
    INTERNAL_ERROR: (Outcome.IO_ERROR, "rpc_failed"),
}


def outcome_of_code(code: int) -> tuple[Outcome, str]:
    """What a negative Mooncake return code means for one block: the outcome, and the
    cause it is counted under (``-200``, no room in the cluster, is a block not
    written, not a failing cluster; ``-800``, its segment unreachable, a miss)."""
    return _OUTCOMES.get(code, (Outcome.IO_ERROR, "error"))
