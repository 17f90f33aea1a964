"""The disk tier's on-disk format (docs/tiers.md has the tables): pure encoding.

A tier directory holds slabs, one per writing process: ``slab-NNNN.data``
(slot ``s`` at byte ``s * slot_bytes``, a sparse file) and
``slab-NNNN.index``, which is

* a header page: the shared-file :class:`~aiokvo.memory.ownership.OwnerHeader`
  (magic ``AIOKVODI``, owner, generation) whose payload is the slab's
  :class:`SlabGeometry` (the layout fingerprint's digest, slot size, slot
  count, entry size, checksum algorithm);
* one fixed-size entry per slot: the key, the payload's checksum, its
  length and a generation, sealed by a checksum of the entry itself. An
  all-zero entry is a free slot.

A block is visible exactly when its entry is committed, and an entry is
written only after its slot's payload was written (and, with
``fsync="commit"``, made durable). Checksums are xxh3-64 (xxhash; it
releases the GIL).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

try:
    import xxhash
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from aiokvo._util import missing_extra

    raise missing_extra(exc, "the disk tier", "disk") from exc

from aiokvo.errors import ConfigError
from aiokvo.keys import MAX_KEY_BYTES, OffloadKey

__all__ = [
    "ALGO_XXH3_64",
    "ENTRY_BYTES",
    "HEADER_PAGE",
    "INDEX_MAGIC",
    "MAX_KEY_BYTES",
    "Entry",
    "SlabGeometry",
    "entry_offset",
    "pack_entry",
    "unpack_entry",
]

INDEX_MAGIC = b"AIOKVODI"
HEADER_PAGE = 4096
"""Bytes before the first entry (and the alignment of slots, for O_DIRECT)."""
ENTRY_BYTES = 128
ALGO_XXH3_64 = 1

_ENTRY = struct.Struct("<QQIHH96s")  # generation, checksum, payload bytes, key bytes, algo, key
_SEAL = struct.Struct("<Q")
assert _ENTRY.size + _SEAL.size == ENTRY_BYTES
_FREE = bytes(ENTRY_BYTES)
_GEOMETRY = struct.Struct("<32sQQII")


@dataclass(frozen=True, slots=True)
class SlabGeometry:
    """A slab's shape, kept in its index header and checked by every reader."""

    digest: bytes
    slot_bytes: int
    num_slots: int
    entry_bytes: int = ENTRY_BYTES
    algo: int = ALGO_XXH3_64

    def pack(self) -> bytes:
        return _GEOMETRY.pack(
            self.digest, self.slot_bytes, self.num_slots, self.entry_bytes, self.algo
        )

    @classmethod
    def unpack(cls, raw: bytes) -> SlabGeometry | None:
        if len(raw) != _GEOMETRY.size:
            return None
        return cls(*_GEOMETRY.unpack(raw))

    @property
    def index_bytes(self) -> int:
        """Size of the index file: header page and entries, in whole pages."""
        return HEADER_PAGE + _round_up(self.num_slots * self.entry_bytes, HEADER_PAGE)

    @property
    def data_bytes(self) -> int:
        """Largest size of the data file (every slot written)."""
        return self.num_slots * self.slot_bytes


GEOMETRY_BYTES = _GEOMETRY.size


@dataclass(frozen=True, slots=True)
class Entry:
    """A committed index entry."""

    key: OffloadKey
    checksum: int
    generation: int
    payload_bytes: int


def entry_offset(slot: int) -> int:
    """Where slot ``slot``'s entry starts in the index file."""
    return HEADER_PAGE + slot * ENTRY_BYTES


def pack_entry(key: OffloadKey, checksum_: int, generation: int, payload_bytes: int) -> bytes:
    """The entry committing ``key`` (``generation`` >= 1) with its payload's checksum."""
    if len(key) > MAX_KEY_BYTES:
        raise ConfigError(f"a disk tier key is at most {MAX_KEY_BYTES} bytes, got {len(key)}")
    body = _ENTRY.pack(generation, checksum_, payload_bytes, len(key), ALGO_XXH3_64, key)
    return body + _SEAL.pack(xxhash.xxh3_64_intdigest(body))


FREE_ENTRY = _FREE
"""The entry of a free slot."""


def unpack_entry(raw: bytes | memoryview) -> Entry | bool | None:
    """The entry in ``raw`` (:data:`ENTRY_BYTES` bytes): an :class:`Entry`, None for a
    free slot, or False for a damaged one (its seal does not match)."""
    raw = bytes(raw)
    if raw == _FREE:
        return None
    if len(raw) != ENTRY_BYTES:
        return False
    body, (seal,) = raw[: _ENTRY.size], _SEAL.unpack_from(raw, _ENTRY.size)
    if xxhash.xxh3_64_intdigest(body) != seal:
        return False
    generation, checksum_, payload, key_len, algo, key = _ENTRY.unpack(body)
    if generation < 1 or algo != ALGO_XXH3_64 or key_len > MAX_KEY_BYTES:
        return False
    return Entry(key[:key_len], checksum_, generation, payload)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
