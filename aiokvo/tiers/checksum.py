"""Checksums for tier blocks: one xxh3 helper, and hashing that overlaps the I/O.

Every tier checksums each block's payload (its pool rows, in order, as if
they were one buffer) with xxh3-64, which releases the GIL and runs several
times faster than any tier's I/O (DESIGN.md, "Checksum speed matters"). A
transfer's checksums are computed while its next I/O runs:

* :class:`OverlappedChecksums` gathers blocks into batches of at least
  :data:`BATCH_BYTES` and hashes each batch on a helper thread while the
  store's thread reads or writes the next one (one hand-off per batch, not
  per block); small batches are hashed inline, where a hand-off costs more;
* :func:`hash_each` splits the hashing of one batch over several threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

try:
    import xxhash
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from aiokvo._util import missing_extra

    raise missing_extra(exc, "aiokvo.tiers.checksum", "disk") from exc

__all__ = ["BATCH_BYTES", "OVERLAP_MIN_BYTES", "OverlappedChecksums", "hash_each", "xxh3"]

OVERLAP_MIN_BYTES = 64 << 10
"""Batches at least this big are hashed on a helper thread while the next I/O runs;
smaller ones inline, where handing over would cost more than it saves."""
BATCH_BYTES = 1 << 20
"""Bytes of blocks gathered before they are handed to the helper thread as one batch,
so the hand-off (a future, a wake-up, GIL round trips) costs per MiB, not per block."""


def xxh3(buffers: Sequence[object]) -> int:
    """xxh3-64 over ``buffers`` in order, as if they were one (the GIL released per buffer)."""
    if len(buffers) == 1:
        return xxhash.xxh3_64_intdigest(buffers[0])  # type: ignore[arg-type]
    hasher = xxhash.xxh3_64()
    for buffer in buffers:
        hasher.update(buffer)  # type: ignore[arg-type]
    return hasher.intdigest()


Blocks = list[Sequence[object]]


def _hash_all(blocks: Blocks) -> list[int]:
    return [xxh3(buffers) for buffers in blocks]


class OverlappedChecksums:
    """The checksums of one job's blocks, hashed in batches while its I/O goes on.

    ``pool`` gives the helper thread (made on first use); None hashes every
    batch inline (a read share: the other shares' I/O overlaps its hashing).
    """

    __slots__ = ("_blocks", "_bytes", "_ids", "_pending", "_pool")

    def __init__(self, pool: Callable[[], ThreadPoolExecutor] | None) -> None:
        self._pool = pool
        self._pending: list[tuple[list[int], list[int] | Future[list[int]]]] = []
        self._ids: list[int] = []
        self._blocks: Blocks = []
        self._bytes = 0

    def add(self, ids: list[int], blocks: Sequence[Sequence[object]], nbytes: int) -> None:
        """Blocks ``ids`` (their buffers ``blocks``, ``nbytes`` together) are ready to hash."""
        self._ids += ids
        self._blocks += blocks
        self._bytes += nbytes
        if self._bytes >= BATCH_BYTES:
            self._hand_off()

    def _hand_off(self) -> None:
        if not self._ids:
            return
        ids, blocks = self._ids, self._blocks
        if self._pool is None or self._bytes < OVERLAP_MIN_BYTES:
            self._pending.append((ids, _hash_all(blocks)))
        else:
            self._pending.append((ids, self._pool().submit(_hash_all, blocks)))
        self._ids, self._blocks, self._bytes = [], [], 0

    def results(self) -> Iterator[tuple[int, int]]:
        """``(block index, checksum)`` of every block added, in the order added."""
        self._hand_off()
        for ids, pending in self._pending:
            found = pending if isinstance(pending, list) else pending.result()
            yield from zip(ids, found, strict=True)


def hash_each(
    work: Callable[[int], None], lo: int, hi: int, threads: int,
    helpers: Callable[[], ThreadPoolExecutor],
) -> None:  # fmt: skip
    """``work(i)`` for every ``i`` of ``lo:hi``, split over ``threads`` threads (this one
    and ``threads - 1`` from ``helpers``: xxh3 releases the GIL)."""
    threads = min(threads, hi - lo)
    if threads <= 1:
        for i in range(lo, hi):
            work(i)
        return
    bounds = [lo + (hi - lo) * t // threads for t in range(threads + 1)]

    def part(a: int, b: int) -> None:
        for i in range(a, b):
            work(i)

    pool = helpers()
    others = [pool.submit(part, bounds[t], bounds[t + 1]) for t in range(1, threads)]
    try:
        part(bounds[0], bounds[1])
    finally:
        for future in others:
            future.result()
