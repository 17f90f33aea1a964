"""Raw copy kernels for scattered pages, against one contiguous torch copy.

What is the best the host backend could do with the tools it may use (numpy,
torch, ctypes; no compiled extension)? Each kernel moves the same workload
as ``bench_host_copy.py`` (``--blocks`` scattered pages in each of
``--tensors`` tensors, random ids on both sides) with no handler, loop or
planning around it, interleaved in a shuffled order every round, next to the
contiguous ``torch`` copy of the same bytes that the issue's target is
relative to. Every kernel's result is checked byte for byte first.

    python benchmarks/bench_copy_kernels.py [--page-kib 32] [--rounds 12]

Kernels:

* ``void``: per tensor, ``dst[d] = src[s]`` on ``np.void`` page elements
  (the host backend's default; holds the GIL).
* ``words``, ``words x2``: the same on int64 rows (releases the GIL), on one
  thread and split over two (``copy_threads=2``).
* ``memcpy``, ``memcpy x2``: one libc ``memcpy`` per page through ctypes,
  driven by ``map`` (no temporary). One thread holding the GIL (``PyDLL``),
  or two threads releasing it around every page (``CDLL``).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import repeat

import numpy as np
import torch


def _two(first: Callable[[], None], second: Callable[[], None]) -> None:
    thread = threading.Thread(target=second)
    thread.start()
    first()
    thread.join()


def _memcpy(dll: ctypes.CDLL) -> Callable[[int, int, int], object]:
    fn = dll.memcpy
    fn.restype = ctypes.c_void_p
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return fn  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-kib", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64, help="pages per tensor per copy")
    parser.add_argument("--tensors", type=int, default=32, help="16 layers x (K, V)")
    parser.add_argument("--pool-blocks", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    page, nb, nt = args.page_kib * 1024, args.blocks, args.tensors
    rng = np.random.default_rng(0)
    src = [torch.randint(-128, 127, (args.pool_blocks, page), dtype=torch.int8) for _ in range(nt)]
    dst = [torch.zeros((args.pool_blocks, page), dtype=torch.int8) for _ in range(nt)]
    s_ids = rng.choice(args.pool_blocks, nb, replace=False).astype(np.int64)
    d_ids = rng.choice(args.pool_blocks, nb, replace=False).astype(np.int64)
    total = nt * nb * page
    voids = [(a.numpy().view((np.void, page)).reshape(-1), b.numpy().view((np.void, page))
              .reshape(-1)) for a, b in zip(src, dst, strict=True)]
    words = [(a.numpy().view(np.int64), b.numpy().view(np.int64))
             for a, b in zip(src, dst, strict=True)]
    s_ptr = (np.array([t.data_ptr() for t in src])[:, None] + s_ids[None, :] * page).ravel()
    d_ptr = (np.array([t.data_ptr() for t in dst])[:, None] + d_ids[None, :] * page).ravel()
    s_list, d_list = s_ptr.tolist(), d_ptr.tolist()
    half = len(s_list) // 2
    holding, releasing = _memcpy(ctypes.PyDLL(None)), _memcpy(ctypes.CDLL(None))

    def fancy(pairs: list[tuple[np.ndarray, np.ndarray]], lo: int = 0, hi: int = nt) -> None:
        for a, b in pairs[lo:hi]:
            b[d_ids] = a[s_ids]

    def pages(fn: Callable[[int, int, int], object], lo: int = 0, hi: int = len(s_list)) -> None:
        deque(map(fn, d_list[lo:hi], s_list[lo:hi], repeat(page, hi - lo)), maxlen=0)

    ref_src = torch.randint(-128, 127, (total,), dtype=torch.int8)
    ref_dst = torch.empty_like(ref_src)
    ref_dst.copy_(ref_src)  # fault the pages in
    def contiguous() -> None:
        ref_dst.copy_(ref_src)

    kernels: dict[str, Callable[[], None]] = {
        "contiguous torch copy_ (reference)": contiguous,
        "void": lambda: fancy(voids),
        "words": lambda: fancy(words),
        "words x2": lambda: _two(lambda: fancy(words, 0, nt // 2),
                                 lambda: fancy(words, nt // 2, nt)),
        "memcpy": lambda: pages(holding),
        "memcpy x2": lambda: _two(lambda: pages(releasing, 0, half),
                                  lambda: pages(releasing, half)),
    }
    sel = (torch.from_numpy(d_ids), torch.from_numpy(s_ids))
    for name, kernel in kernels.items():
        if name.startswith("contiguous"):
            continue
        for t in dst:
            t.zero_()
        kernel()
        assert all(torch.equal(b[sel[0]], a[sel[1]]) for a, b in zip(src, dst, strict=True)), name
    times: dict[str, list[float]] = {name: [] for name in kernels}
    order = list(kernels)
    shuffle = random.Random(1)
    for _ in range(args.rounds):
        shuffle.shuffle(order)
        for name in order:
            start = time.perf_counter()
            kernels[name]()
            times[name].append(time.perf_counter() - start)
    rates = {name: total / statistics.median(ts) / 1e9 for name, ts in times.items()}
    reference = rates["contiguous torch copy_ (reference)"]
    print(f"# {nt} tensors x {nb} scattered {args.page_kib} KiB pages = {total / 2**20:.0f} MiB "
          f"per copy, median of {args.rounds}; torch threads={torch.get_num_threads()}")
    print("| kernel | GB/s | vs contiguous |\n|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.2f} | {rate / reference:.0%} |")


if __name__ == "__main__":
    main()
