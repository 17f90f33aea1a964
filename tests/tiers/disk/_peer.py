"""The other process of the two-process sharing test (``test_processes.py``).

Run as ``python -m tests.tiers.disk._peer ROOT`` from the repository root. It
opens its own Offloader (own CPU pool) with a disk tier in ``ROOT``, stores
:data:`SHARED` with salt ``A`` and prints ``stored``; on the line ``race`` on
stdin it runs :func:`race` against the test process and prints ``done
LOADED WRONG STALE``. It exits non-zero if it loads a wrong byte.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import aiokvo
from aiokvo import Offloader
from tests.tiers.disk._util import KV, fill, is_disk_tier, keys, offloader

SHARED = keys("proc-shared", 4)
RACE = keys("proc-race", 16)
SALTS = (b"A", b"B")
ROUNDS = 40
TIER_SLOTS = 8  # fewer than RACE: slots are reused, under the other process's reads
CPU_BLOCKS = 4


def open_offloader(kv: KV, root: Path) -> Offloader:
    return offloader(kv, root, cpu_blocks=CPU_BLOCKS, slots=TIER_SLOTS, max_write_blocks=4)


async def race(off: Offloader, kv: KV, seed: int) -> tuple[int, int]:
    """Store and load the same keys as the other process; (blocks loaded, wrong blocks)."""
    tier = off.tiers[0]
    assert is_disk_tier(tier)
    rng = random.Random(seed)
    loaded = wrong = 0
    for _ in range(ROUNDS):
        await fill(off, kv, rng.sample(RACE, 4))
        await tier.maintain()
        want = rng.sample(RACE, 4)
        blocks = [40, 41, 42, 43]
        kv.clear(blocks)
        n = await off.load_prefix(want, blocks)
        loaded += n
        got = zip(blocks[:n], want[:n], strict=True)
        wrong += sum(kv.version(b, k, SALTS) is None for b, k in got)
    return loaded, wrong


async def main(root: Path) -> int:
    kv = KV(salt=SALTS[0])
    async with open_offloader(kv, root) as off:
        await fill(off, kv, SHARED, start=10)
        print("stored", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if line.strip() != "race":
            return 2
        loaded, wrong = await race(off, kv, seed=1)
        stale = off.statistics().tiers[0].stale_reads  # type: ignore[attr-defined]
        print(f"done {loaded} {wrong} {stale}", flush=True)
        return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(aiokvo.run(main(Path(sys.argv[1]))))
