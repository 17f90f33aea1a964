"""How large the CPU pool must be once a tier's write-through pins blocks.

Run:  .venv/bin/python benchmarks/bench_pool_sizing.py [--rounds 8] [--dir DIR]

``C`` coroutines each serve requests of ``L`` new blocks: ``store`` them, then
``load_prefix`` them back (a scheduler's step for one request: offload what it
computed, reload a prefix). The pool holds ``m x C x L`` blocks for ``m`` from
1 to 3, and the tier below it is, in turn: none (the CPU pool alone); a disk
tier on the page cache (``fsync="none"``, the default); the same with
``fsync="commit"``; and a disk tier whose writes are throttled to a slow
disk's speed (a ``FileIO`` that sleeps per write, through the tier's public
``file_io`` seam). Printed per (C, L, tier, m): the share of stores refused
for lack of room, the writes skipped because write-through already pinned its
share, and the most blocks write-through pinned at one time (sampled at every
refusal and step). The rule in docs/tiers.md ("Sizing the CPU pool") comes from
the smallest ``m`` with no refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import aiokvo
from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, make_offload_key
from aiokvo.tiers import DiskTier, FileIO, Tier

PAGE = 8 << 10  # bytes per block and tensor; two tensors (K and V)
MULTIPLES = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
SHAPES = ((4, 8), (4, 32), (16, 8), (16, 32))  # (C coroutines, L blocks per request)
SLOW_BYTES_PER_S = 200e6  # a slow disk's write speed, for the throttled tier


class SlowDisk(FileIO):
    """Writes that take as long as a disk writing ``SLOW_BYTES_PER_S`` would."""

    def pwritev(self, fd: int, buffers: Sequence[object], offset: int) -> int:
        done = super().pwritev(fd, buffers, offset)  # type: ignore[arg-type]
        time.sleep(done / SLOW_BYTES_PER_S)
        return done


@dataclass
class Outcome:
    stores: int
    refused: int
    skipped_writes: int
    peak_write_pins: int


KINDS = ("cpu", "disk", "disk-fsync", "disk-slow", "disk-quarter")
"""The tiers below the pool; ``disk-quarter`` lets write-through pin a quarter of the
pool (``max_write_blocks``) instead of the default half."""


def predicted(kind: str) -> float:
    """The rule's smallest multiple: ``pool - max_write_blocks >= C x L``."""
    share = {"cpu": 0.0, "disk-quarter": 0.25}.get(kind, 0.5)
    return 1 / (1 - share)


def _tier(kind: str, root: Path, pool: int) -> list[Tier]:
    capacity = 256 << 20
    if kind == "cpu":
        return []
    if kind == "disk":
        return [DiskTier(root, capacity_bytes=capacity, model_id="sizing")]
    if kind == "disk-quarter":
        return [DiskTier(root, capacity_bytes=capacity, model_id="sizing",
                         max_write_blocks=max(1, pool // 4))]
    if kind == "disk-fsync":
        return [DiskTier(root, capacity_bytes=capacity, model_id="sizing", fsync="commit")]
    if kind == "disk-slow":
        return [DiskTier(root, capacity_bytes=capacity, model_id="sizing", file_io=SlowDisk())]
    raise ValueError(kind)


async def run(kind: str, coroutines: int, blocks: int, multiple: float, rounds: int,
              root: Path) -> Outcome:  # fmt: skip
    layers = [torch.zeros(coroutines * blocks, PAGE, dtype=torch.int8) for _ in range(2)]
    kv = CanonicalKVCaches.from_engine(layers)
    pool = math.ceil(multiple * coroutines * blocks)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=kv.page_bytes_per_block,
        cpu_bytes_to_use=pool * kv.page_bytes_per_block,
    )  # fmt: skip
    peak = 0
    async with Offloader(config, kv, tiers=_tier(kind, root, pool)) as off:

        def sample() -> None:
            nonlocal peak
            tiers = off._tiers  # the driver's count of blocks pinned by tier writes
            if tiers is not None:
                peak = max(peak, tiers.pinned_by_writes)

        async def client(c: int) -> None:
            mine = list(range(c * blocks, (c + 1) * blocks))
            for r in range(rounds):
                keys = [make_offload_key(f"{kind}-{c}-{r}-{i}".encode(), 0) for i in range(blocks)]
                result = await off.store(keys, mine)
                sample()
                if result.stored:
                    await off.load_prefix(keys, mine)
                sample()

        await asyncio.gather(*(client(c) for c in range(coroutines)))
        s = off.statistics()
    return Outcome(s.stores, s.stores_refused, s.tier_writes_skipped, peak)


async def main(args: argparse.Namespace) -> None:
    logging.getLogger("aiokvo.offloader").setLevel(logging.ERROR)  # refusals are the point
    print(f"# CPU pool sizing under write-through; block {2 * PAGE // 1024} KiB, "
          f"{args.rounds} requests per coroutine; nproc {os.cpu_count()}")
    print("Each cell: stores refused / stores, tier writes skipped, peak blocks pinned by "
          "write-through.")
    print("| C | L | tier | " + " | ".join(f"m={m:g}" for m in MULTIPLES)
          + " | smallest m | rule: 1/(1-share) |")
    print("|---|---|---|" + "---|" * len(MULTIPLES) + "---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for coroutines, blocks in SHAPES:
            for kind in KINDS:
                cells = []
                smallest: float | None = None
                for i, multiple in enumerate(MULTIPLES):
                    root = Path(tmp, f"{kind}-{coroutines}-{blocks}-{i}")
                    root.mkdir(mode=0o700)
                    o = await run(kind, coroutines, blocks, multiple, args.rounds, root)
                    cells.append(f"{o.refused}/{o.stores}, {o.skipped_writes}, {o.peak_write_pins}")
                    if o.refused == 0 and smallest is None:
                        smallest = multiple
                found = f"{smallest:g}" if smallest is not None else "> 3"
                print(f"| {coroutines} | {blocks} | {kind} | " + " | ".join(cells)
                      + f" | {found} | {predicted(kind):.2f} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where the disk tiers live (default: /tmp)")
    aiokvo.run(main(parser.parse_args()))
