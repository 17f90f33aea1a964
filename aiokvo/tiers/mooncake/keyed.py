"""The keyed trailer: blocks a client without the deployment's key cannot plant.

The plain trailer (:mod:`~aiokvo.tiers.mooncake.format`) catches accidents:
a torn write, a flipped bit, another layout's object. Its xxh3 is not keyed,
so any client of the cluster can write a block of its choosing with a
matching trailer, and every replica would serve it. With ``integrity_key``
set, each object carries instead a GMAC (AES-GCM over no plaintext, from the
``cryptography`` package) keyed per deployment, over the trailer's identity
fields and the whole payload:

=======  =====  ====================================================
offset   bytes  field
=======  =====  ====================================================
0        8      magic ``AIOKVOMK``
8        16     the first 16 bytes of the layout fingerprint's digest
24       8      xxh3-64 of the :class:`~aiokvo.OffloadKey`
32       8      payload bytes
40       12     the nonce (random per write)
52       12     the tag: GMAC over bytes 0..52 and the payload (96 bits)
=======  =====  ====================================================

A block is good only if the tag verifies: a writer without the key cannot
make one, and an object copied under another key's name fails (the key is
inside what the tag covers). Keyed objects live in a namespace of their own
(``<fingerprint>-k<key id>``), so keyed and plain tiers, or two keys, never
read each other's blocks. The nonce is 96 random bits: unique per write with
overwhelming probability up to far more writes than one key will see.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from aiokvo.tiers.mooncake.format import TRAILER_BYTES

__all__ = ["KEYED_MAGIC", "KeyedTrailers"]

KEYED_MAGIC = b"AIOKVOMK"
_HEAD = struct.Struct("<8s16sQQ12s")  # magic, layout, key hash, length, nonce
_TAG_BYTES = 12
assert _HEAD.size + _TAG_BYTES == TRAILER_BYTES


class KeyedTrailers:
    """Seals and checks keyed trailers with one deployment key (thread-safe)."""

    def __init__(self, key: bytes) -> None:
        self._aes = algorithms.AES(key)
        # A name for the key that says nothing about it: it separates namespaces.
        self.key_id = hmac.new(key, b"aiokvo mooncake key id", hashlib.sha256).hexdigest()[:16]

    def _mac(self, head: bytes, nonce: bytes, payload: Sequence[object]) -> bytes:
        encryptor = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(head)
        for buffer in payload:
            encryptor.authenticate_additional_data(buffer)  # type: ignore[arg-type]
        encryptor.finalize()
        return encryptor.tag[:_TAG_BYTES]

    def seal(self, layout: bytes, key_hash: int, payload: Sequence[object], length: int) -> bytes:
        """The 64-byte trailer of a block whose ``payload`` buffers hold ``length`` bytes."""
        nonce = os.urandom(12)
        head = _HEAD.pack(KEYED_MAGIC, layout, key_hash, length, nonce)
        return head + self._mac(head, nonce, payload)

    def check(
        self, trailer: bytes, layout: bytes, key_hash: int, payload: Sequence[object],
        length: int,
    ) -> bool:  # fmt: skip
        """Whether ``trailer`` vouches for this layout, key, length and ``payload``."""
        if len(trailer) != TRAILER_BYTES:
            return False
        head, tag = trailer[: _HEAD.size], trailer[_HEAD.size :]
        magic, digest, found_key, found_length, nonce = _HEAD.unpack(head)
        if magic != KEYED_MAGIC or digest != layout or found_key != key_hash or (
            found_length != length
        ):  # fmt: skip
            return False
        try:
            return hmac.compare_digest(self._mac(head, nonce, payload), tag)
        except InvalidTag:  # pragma: no cover - the encryptor does not verify
            return False
