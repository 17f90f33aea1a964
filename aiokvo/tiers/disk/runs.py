"""Adjacent slots moved in one system call: grouping a transfer's blocks into runs (pure).

A run is blocks whose slots follow one another in one slab, each but the
last filling its slot whole (so the run's bytes are one contiguous range of
the data file): one ``preadv``/``pwritev`` with every block's rows as the
iovecs moves all of them. Fewer, larger calls are what the device is
fastest at (measured in ``benchmarks/RESULTS.md``, "Disk tier"); each
block keeps its own checksum and its own outcome.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["DEFAULT_MAX_IO_BYTES", "IOV_MAX", "adjacent_runs"]

DEFAULT_MAX_IO_BYTES = 4 << 20
"""Bytes one coalesced call moves at most: large enough to amortise the call
(several 256 KiB blocks), small enough that verifying one run overlaps the
next run's I/O instead of waiting for the whole transfer."""


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
    block ``i`` when it is the next slot of the same slab, ``i`` fills its
    slot (no gap between them), and the run stays within ``max_bytes`` and
    ``max_iovecs``. A block alone is a run whatever its size.
    """
    runs: list[list[int]] = []
    run: list[int] = []
    nbytes = nvecs = 0
    prev = -1
    for i in order:
        if (
            run
            and slabs[i] == slabs[prev]
            and slots[i] == slots[prev] + 1
            and sizes[prev] == slot_bytes
            and nbytes + sizes[i] <= max_bytes
            and nvecs + iovecs[i] <= max_iovecs
        ):
            run.append(i)
            nbytes += sizes[i]
            nvecs += iovecs[i]
        else:
            if run:
                runs.append(run)
            run = [i]
            nbytes, nvecs = sizes[i], iovecs[i]
        prev = i
    if run:
        runs.append(run)
    return runs
