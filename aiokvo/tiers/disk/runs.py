"""Adjacent slots moved in one system call: grouping a transfer's blocks into runs (pure).

A run is blocks whose slots follow one another in one slab, in either
direction, each filling its slot whole except the one last in the file (so
the run's bytes are one contiguous range of the data file): one
``preadv``/``pwritev`` with every block's rows as the iovecs, in file order,
moves all of them. Fewer, larger calls are what the device is fastest at
(measured in ``benchmarks/RESULTS.md``, "Disk tier"); each block keeps its
own checksum and its own outcome. Descending runs matter for writes: slots
freed together come back from the slot pool last-freed first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = [
    "DEFAULT_MAX_IO_BYTES",
    "DEFAULT_READ_THREADS",
    "IOV_MAX",
    "PARALLEL_READ_MIN_BYTES",
    "adjacent_runs",
    "shares",
]

DEFAULT_MAX_IO_BYTES = 4 << 20
"""Bytes one coalesced call moves at most: large enough to amortise the call
(several 256 KiB blocks), small enough that verifying one run overlaps the
next run's I/O instead of waiting for the whole transfer."""

DEFAULT_READ_THREADS = 2
"""Reads of one transfer in flight at once (queue depth). Two let one thread's
checksum pass overlap the other's I/O and keep the device busy between calls;
disks with deep queues (NVMe) take more. Measured in ``benchmarks/RESULTS.md``."""

PARALLEL_READ_MIN_BYTES = 1 << 20
"""Reads smaller than this stay on one thread: handing a share to another
costs tens of microseconds, more than reading a few small blocks."""


def _iov_max() -> int:
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        value = -1
    return value if value > 0 else 1024


IOV_MAX = _iov_max()
"""iovecs one ``preadv``/``pwritev`` takes (Linux: 1024)."""


def adjacent_runs(
    order: Sequence[int],
    slabs: Sequence[int],
    slots: Sequence[int],
    sizes: Sequence[int],
    iovecs: Sequence[int],
    *,
    slot_bytes: int,
    max_bytes: int,
    max_iovecs: int = IOV_MAX,
) -> list[list[int]]:
    """Split ``order`` (block indices) into runs, keeping its order.

    Block ``i`` is ``sizes[i]`` bytes in ``iovecs[i]`` buffers at slot
    ``slots[i]`` of slab ``slabs[i]``. Block ``j`` joins the run ending with
    block ``i`` when it is in the same slab, in the slot right after ``i``'s
    (or right before it, for a descending run: a run keeps one direction),
    the block earlier in the file fills its slot (no gap between them), and
    the run stays within ``max_bytes`` and ``max_iovecs``. A block alone is a
    run whatever its size; a descending run's blocks are in the file in
    reverse.
    """
    runs: list[list[int]] = []
    run: list[int] = []
    nbytes = nvecs = 0
    step = 0  # the run's direction: +1, -1, or 0 while it has one block
    prev = -1
    for i in order:
        if run and slabs[i] == slabs[prev] and nbytes + sizes[i] <= max_bytes and (
            nvecs + iovecs[i] <= max_iovecs
        ):
            delta = slots[i] - slots[prev]
            lower = prev if delta == 1 else i  # the block earlier in the file
            if delta in (1, -1) and step in (0, delta) and sizes[lower] == slot_bytes:
                run.append(i)
                nbytes += sizes[i]
                nvecs += iovecs[i]
                step = delta
                prev = i
                continue
        if run:
            runs.append(run)
        run = [i]
        nbytes, nvecs, step = sizes[i], iovecs[i], 0
        prev = i
    if run:
        runs.append(run)
    return runs


def shares(runs: list[list[int]], n: int) -> list[list[list[int]]]:
    """``runs`` cut into at most ``n`` contiguous shares of about as many blocks each
    (contiguous: each share's reads stay sequential in the file); no share is empty."""
    total = sum(len(run) for run in runs)
    if n <= 1 or total == 0:
        return [runs] if runs else []
    cut: list[list[list[int]]] = [[] for _ in range(n)]
    done = 0
    for run in runs:
        cut[min(n - 1, done * n // total)].append(run)
        done += len(run)
    return [share for share in cut if share]
