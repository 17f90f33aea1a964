"""What a competent engineer would write instead of a tier: the baselines of bench_tiers.

Each baseline moves the same CPU-pool rows as the tier it is measured
against, with the same library calls, the same call sizes, the same queue
depth and the same checksum, so a ratio measures what the tier adds, not
what a careless loop loses:

* :class:`RawDisk`: ``os.pwritev`` / ``os.preadv`` on one preallocated file
  (overwritten in place, never truncated), blocks at the tier's slot offsets,
  adjacent blocks coalesced into calls of up to ``max_io_bytes``, O_DIRECT
  when the tier uses it. Writes: one call at a time in order, each call's
  blocks hashed (xxh3-64 per block) on a helper thread while it is written.
  Reads: ``read_threads`` contiguous shares at once, each thread verifying a
  call's blocks while the other's call is in flight. ``checksum=False`` is the
  same I/O with no checksum at all (the floor's denominator).
* :class:`RawMooncake`: ``batch_put_from`` / ``batch_get_into`` of each row
  and its room (one buffer per block, the tier's own objects' size) on the
  tier's own client; by hand, the xxh3 of every row kept in its room before
  the put and verified after the get, or a GMAC (AES-GCM over no plaintext,
  ``cryptography``) over the block's identity and row, on ``threads`` threads
  as the tier's ``checksum_threads``.
"""

from __future__ import annotations

import hmac
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch
import xxhash

__all__ = ["RawDisk", "RawMooncake", "split"]


def split(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous pieces (none empty)."""
    parts = max(1, min(parts, n))
    bounds = [n * p // parts for p in range(parts + 1)]
    return [range(bounds[p], bounds[p + 1]) for p in range(parts)]


def _xxh3(buffers: Sequence[Any]) -> int:
    if len(buffers) == 1:
        return xxhash.xxh3_64_intdigest(buffers[0])
    hasher = xxhash.xxh3_64()
    for buffer in buffers:
        hasher.update(buffer)
    return hasher.intdigest()


class RawDisk:
    """Blocks ``rows[b]`` (each a list of row buffers) at ``b * slot_bytes`` of ``path``.

    The file is made ``len(rows) * slot_bytes`` long and written whole once
    (:meth:`preallocate`), so every measured write overwrites allocated blocks,
    as the tier's writes overwrite its slots.
    """

    def __init__(
        self, path: os.PathLike[str] | str, rows: list[list[np.ndarray]], slot_bytes: int, *,
        direct: bool, max_io_bytes: int, read_threads: int,
    ) -> None:  # fmt: skip
        self.rows = rows
        self.slot_bytes = slot_bytes
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
        self.views = [[memoryview(b).cast("B") for b in block] for block in rows]
        per_call = max(1, max_io_bytes // slot_bytes)
        # Calls of adjacent blocks: (first block, blocks, the iovecs).
        self.calls = [
            (lo, range(lo, min(lo + per_call, len(rows))),
             [v for b in range(lo, min(lo + per_call, len(rows))) for v in self.views[b]])
            for lo in range(0, len(rows), per_call)
        ]  # fmt: skip
        self.read_threads = read_threads
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="raw-disk-hash")
        self._readers = ThreadPoolExecutor(max(1, read_threads - 1),
                                           thread_name_prefix="raw-disk-read")  # fmt: skip
        self.checksums = [0] * len(rows)

    def close(self) -> None:
        self._hasher.shutdown()
        self._readers.shutdown()
        os.close(self.fd)

    def preallocate(self) -> None:
        """Write every block once (unmeasured): later writes overwrite them."""
        self.checksums = self.write(checksum=True)

    def _hash(self, blocks: range) -> list[int]:
        rows = self.rows
        return [_xxh3(rows[b]) for b in blocks]

    def write(self, *, checksum: bool) -> list[int]:
        """Every block, one coalesced call at a time, in order; their checksums."""
        fd, slot = self.fd, self.slot_bytes
        pending: list[Future[list[int]]] = []
        for lo, blocks, iovecs in self.calls:
            if checksum:  # hashed on the helper while this call writes
                pending.append(self._hasher.submit(self._hash, blocks))
            total = sum(v.nbytes for v in iovecs)
            if os.pwritev(fd, iovecs, lo * slot) != total:
                raise OSError(f"short write at block {lo}")
        if not checksum:
            return self.checksums
        return [value for future in pending for value in future.result()]

    def _read_share(self, calls: list[Any], checksum: bool) -> int:
        """Read ``calls`` in order, verifying each call's blocks after it; bad blocks."""
        fd, slot, rows, expected = self.fd, self.slot_bytes, self.rows, self.checksums
        bad = 0
        for lo, blocks, iovecs in calls:
            total = sum(v.nbytes for v in iovecs)
            if os.preadv(fd, iovecs, lo * slot) != total:
                raise OSError(f"short read at block {lo}")
            if checksum:
                for b in blocks:
                    bad += _xxh3(rows[b]) != expected[b]
        return bad

    def read(self, *, checksum: bool) -> int:
        """Every block, ``read_threads`` contiguous shares at once; blocks that failed."""
        calls = self.calls
        shares = [calls[r.start : r.stop] for r in split(len(calls), self.read_threads)]
        others = [self._readers.submit(self._read_share, s, checksum) for s in shares[1:]]
        try:
            bad = self._read_share(shares[0], checksum)
        finally:
            wait(others)  # never return while a share may still read into the rows
        return bad + sum(f.result() for f in others)


_HEAD = struct.Struct("<QQ12s")  # key hash, length, nonce: what the GMAC binds with the row


class RawMooncake:
    """Raw calls on the tier's own Mooncake ``store`` over the pool ``pool`` (rows of
    ``block_bytes`` with at least 64 bytes of room after each, one buffer per block)."""

    def __init__(self, store: Any, pool: torch.Tensor, block_bytes: int, *, threads: int,
                 key: bytes) -> None:  # fmt: skip
        from cryptography.hazmat.primitives.ciphers import algorithms

        self.store = store
        n = int(pool.shape[0])
        stride = int(pool.stride(0))
        self.n, self.block_bytes = n, block_bytes
        self.ptrs = [pool.data_ptr() + b * stride for b in range(n)]
        self.sizes = [block_bytes + 64] * n  # each row and its room: the tier's object size
        self.rows = [pool[b].numpy().view(np.uint8) for b in range(n)]
        room = torch.as_strided(pool, (n, 64), (stride, 1), pool.storage_offset() + block_bytes)
        self.room = room.numpy().view(np.uint8)
        self.threads = threads
        self._pool = ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="raw-mc-hash")
        self._aes = algorithms.AES(key)

    def close(self) -> None:
        self._pool.shutdown()

    def _each(self, work: Callable[[range], int]) -> int:
        """``work`` over the blocks, split over ``threads`` threads (this one and helpers)."""
        parts = split(self.n, self.threads)
        others = [self._pool.submit(work, part) for part in parts[1:]]
        try:
            total = work(parts[0])
        finally:
            wait(others)
        return total + sum(f.result() for f in others)

    # ----------------------------------------------------------- the calls
    def put(self, names: list[str]) -> None:
        codes = self.store.batch_put_from(names, self.ptrs, self.sizes)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"raw put failed: {sorted(set(codes))}")

    def get(self, names: list[str]) -> None:
        codes = self.store.batch_get_into(names, self.ptrs, self.sizes)
        if any(c != self.block_bytes + 64 for c in codes):
            raise RuntimeError(f"raw get failed: {sorted(set(codes))}")

    # ------------------------------------------------------ xxh3 by hand
    def hash_then_put(self, names: list[str]) -> None:
        sums = np.zeros(self.n, dtype="<u8")
        rows = self.rows

        def hash_rows(part: range) -> int:
            for b in part:
                sums[b] = xxhash.xxh3_64_intdigest(rows[b])
            return 0

        self._each(hash_rows)
        self.room[:, :8] = sums.view(np.uint8).reshape(self.n, 8)  # kept in the row's room
        self.put(names)

    def get_then_verify(self, names: list[str]) -> int:
        self.get(names)
        stored = self.room[:, :8].copy().view("<u8").reshape(self.n)
        rows = self.rows

        def verify(part: range) -> int:
            return sum(xxhash.xxh3_64_intdigest(rows[b]) != stored[b] for b in part)

        return self._each(verify)

    # ------------------------------------------------------ GMAC by hand
    def _mac(self, b: int, nonce: bytes) -> bytes:
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        encryptor = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(_HEAD.pack(b, self.block_bytes, nonce))
        encryptor.authenticate_additional_data(self.rows[b])
        encryptor.finalize()
        return encryptor.tag[:12]

    def mac_then_put(self, names: list[str]) -> None:
        room = self.room

        def seal(part: range) -> int:
            for b in part:
                nonce = os.urandom(12)
                room[b, :12] = np.frombuffer(nonce, dtype=np.uint8)
                room[b, 12:24] = np.frombuffer(self._mac(b, nonce), dtype=np.uint8)
            return 0

        self._each(seal)
        self.put(names)

    def get_then_check_mac(self, names: list[str]) -> int:
        self.get(names)
        room = self.room

        def check(part: range) -> int:
            bad = 0
            for b in part:
                kept = room[b, :24].tobytes()
                bad += not hmac.compare_digest(self._mac(b, kept[:12]), kept[12:])
            return bad

        return self._each(check)
