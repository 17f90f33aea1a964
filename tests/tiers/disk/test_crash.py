"""Crash safety in real processes: SIGKILL mid-write, and a real filesystem that fills up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.tiers.disk._util import KV, is_disk_tier, keys, offloader

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from pathlib import Path
    import aiokvo
    from aiokvo.tiers import FileIO
    from tests.tiers.disk._util import KV, fill, keys, offloader

    root, mid = Path(sys.argv[1]), Path(sys.argv[2])

    class HalfThenHang(FileIO):
        armed = False
        def pwritev(self, fd, buffers, offset):
            if not self.armed:
                return super().pwritev(fd, buffers, offset)
            first = memoryview(buffers[0]).cast("B")
            os.pwrite(fd, first[: len(first) // 2], offset)  # half a block on disk
            mid.touch()
            time.sleep(600)  # killed here
            raise AssertionError("not killed")

    async def main():
        kv, io = KV(), HalfThenHang()
        off = offloader(kv, root, file_io=io)
        await off.open()
        await fill(off, kv, keys("done", 4))
        io.armed = True
        await fill(off, kv, keys("torn", 4), start=4)  # its disk write hangs half-way

    aiokvo.run(main())
    """
)


async def test_sigkill_mid_write_never_yields_a_torn_block(disk_tier_path: Path) -> None:
    mid = disk_tier_path.parent / "mid-write"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(disk_tier_path), str(mid)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not mid.exists():
            assert child.poll() is None, child.communicate()[0].decode()
            assert time.monotonic() < deadline, "the child never reached the write"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    kv = KV()
    done, torn = keys("done", 4), keys("torn", 4)
    # A probe file of a process that died mid-probe is a temporary too.
    async with offloader(kv, disk_tier_path) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        stats = tier.statistics()
        assert stats.adopted_blocks == 4 and stats.used_blocks == 4  # the torn slot is free
        assert not any(tier.index.holds(k) for k in torn)
        assert await off.load_prefix(done, [20, 21, 22, 23]) == 4
        assert kv.holds([20, 21, 22, 23], done)
        assert await off.load_prefix(torn, [30, 31, 32, 33]) == 0
        names = sorted(os.listdir(tier.store.directory))
    assert names == ["slab-0000.data", "slab-0000.index"]


async def test_a_probe_left_by_a_dead_process_is_removed(disk_tier_path: Path) -> None:
    kv = KV()
    async with offloader(kv, disk_tier_path) as off:
        tier = off.tiers[0]
        assert is_disk_tier(tier)
        directory = tier.store.directory
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, check=True, text=True)  # fmt: skip
    probe = directory / f".probe-{int(dead.stdout)}-0badc0de"
    probe.write_bytes(b"")
    async with offloader(kv, disk_tier_path):
        pass
    assert not probe.exists()


SMALL_FS = textwrap.dedent(
    """
    import asyncio, os, subprocess, sys
    from pathlib import Path
    import aiokvo
    from aiokvo.tiers import DiskTier
    from tests.tiers.disk._util import KV, keys, offloader

    root = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(root)],
                   check=True)

    async def main():
        kv = KV()  # 8 KiB blocks: a 256 KiB filesystem holds fewer than 32 of them
        ks = keys("fs", 40)
        async with offloader(kv, root, cpu_blocks=40, slots=40) as off:
            for i in range(0, 40, 4):
                kv.write(range(i, i + 4), ks[i:i + 4])
                assert (await off.store(ks[i:i + 4], list(range(i, i + 4)))).ok
                await off.drain()
            tier = off.tiers[0]
            stats = tier.statistics()
            assert stats.write_failures > 0, stats
            assert stats.evictions == 0 and stats.blocks_written == stats.used_blocks, stats
            assert 0 < stats.blocks_written < 40, stats
            assert stats.breaker.state == "open", stats  # a full disk keeps failing: out
            written = [k for k in ks if tier.index.holds(k)]
            assert written == ks[: len(written)], (len(written), [tier.index.holds(k) for k in ks])
            print("written", len(written))
        async with offloader(kv, root, cpu_blocks=40, slots=40) as off:
            n = len(written)
            kv.clear(range(64))
            got = await off.load_prefix(ks[:n], list(range(0, n)))
            assert got == n and kv.holds(range(0, n), ks[:n]), got
        print("ok")

    aiokvo.run(main())
    """
)


def test_a_real_full_filesystem_fails_stores_cleanly(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs in a private namespace")
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace here: {probe.stderr!r}")
    root = tmp_path / "small"
    root.mkdir(mode=0o700)
    run = subprocess.run(
        [unshare, "-rm", sys.executable, "-c", SMALL_FS, str(root)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok" in run.stdout
