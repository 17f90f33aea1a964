"""Two real processes on one tier directory (engine replicas on one host).

The other process is ``tests/tiers/disk/_peer.py``, its own interpreter with
its own Offloader and CPU pool: it shares nothing with this one but the
directory. Each process writes its own salt's bytes for the same keys, so a
block mixing two writes, or a slot read while its writer reuses it, would
show as bytes that are neither version.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import pytest

from tests.tiers.disk import _peer
from tests.tiers.disk._util import KV, is_disk_tier

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[3]
PATIENCE = 60.0  # seconds for any one step of the other process (it imports torch)


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(proc.stdout.readline(), PATIENCE)).decode().strip()


async def test_a_block_stored_by_another_process_is_found_after_refresh_and_races_are_safe(
    disk_tier_path: Path,
) -> None:
    kv = KV(salt=_peer.SALTS[1])
    async with _peer.open_offloader(kv, disk_tier_path) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.tiers.disk._peer", str(disk_tier_path),
            cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert await _line(proc) == "stored"
            shared = _peer.SHARED
            blocks = list(range(20, 20 + len(shared)))
            assert await off.load_prefix(shared, blocks) == 0  # not before our refresh
            await tier.maintain()
            assert tier.statistics().foreign_blocks == len(shared)
            where = tier.index.location(shared[0])
            assert where is not None and where.slab != tier.index.slab  # one writer per slab
            assert await off.load_prefix(shared, blocks) == len(shared)
            ours = zip(blocks, shared, strict=True)
            assert all(kv.version(b, k, [b"A"]) == b"A" for b, k in ours)
            assert off.statistics().hits_by_medium["DISK"] == len(shared)

            # Both processes store and load the same keys at once, reusing their slots.
            assert proc.stdin is not None
            proc.stdin.write(b"race\n")
            await proc.stdin.drain()
            loaded, wrong = await _peer.race(off, kv, seed=2)
            word, peer_loaded, peer_wrong, peer_stale = (await _line(proc)).split()
            assert word == "done"
            assert await asyncio.wait_for(proc.wait(), PATIENCE) == 0
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        assert (wrong, int(peer_wrong)) == (0, 0)  # never a wrong byte, in either process
        assert loaded > 0 and int(peer_loaded) > 0
        stale = tier.statistics().stale_reads + int(peer_stale)
        print(f"race: loaded {loaded} + {peer_loaded}, stale reads {stale}")
    # Afterwards every block either slab still commits reads back as one writer's bytes.
    fresh = KV(salt=b"C")
    async with _peer.open_offloader(fresh, disk_tier_path) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        await tier.maintain()
        found = [k for k in _peer.RACE if tier.index.holds(k)]
        assert found
        for k in found:
            assert await off.load_prefix([k], [50]) == 1
            assert fresh.version(50, k, _peer.SALTS) is not None
