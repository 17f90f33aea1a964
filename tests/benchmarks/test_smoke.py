"""The benchmarks' quick modes run to the end (they are not part of the package,
so nothing else would notice one crashing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


def test_bench_async_quick_runs_its_host_copy_section() -> None:
    # bench_async used to hand --quick on to bench_host_copy, which had no such flag.
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_async.py", "--quick", "--only", "host"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "## 3. Host-copy bandwidth" in out.stdout
    assert "32Ki" in out.stdout  # a row of the host-copy table


def test_bench_tiers_mooncake_section_runs_on_a_local_cluster() -> None:
    from aiokvo.testing.mooncake import require_mooncake

    require_mooncake()
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_tiers.py", "--no-disk", "--mooncake", "local",
         "--mib", "16", "--rounds", "1", "--mooncake-blocks", "512", "--pool", "16",
         "--requests", "20"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "## Mooncake, on a loopback cluster" in out.stdout
    assert "| 512 KiB | put | 1 |" in out.stdout  # the plain tier against the check by hand
    assert "| 512 KiB | get | 1 |" in out.stdout
    assert "| keyed / GMAC by hand |" in out.stdout
    assert out.stdout.count("| 512 KiB | get | 1 |") == 2  # and the keyed tier
    assert "| with the Mooncake tier |" in out.stdout


def test_bench_replay_quick_prints_every_section_for_every_policy() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_replay.py", "--quick", "--capacity", "0.05"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "## 1. Replay speed" in out.stdout and "## 2. Bytes per cached block" in out.stdout
    assert "## 3. A second workload" in out.stdout and "| Belady |" in out.stdout
    for policy in ("lru", "arc", "slru", "sieve", "s3fifo", "chain"):
        assert out.stdout.count(f"| {policy} |") == 3, policy  # a row in each table


def test_bench_tiers_disk_sections_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_tiers.py", "--mooncake", "off", "--dir",
         str(tmp_path), "--mib", "8", "--rounds", "1", "--blocks", "256", "--pool", "16",
         "--requests", "20"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for op in ("write", "read", "warm read"):  # against the raw with the same checksum
        assert f"| 256 KiB | {op} | 1 |" in out.stdout
    assert "| CPU pool + disk tier |" in out.stdout
    # The figures that explain a replay below the pool alone (tier writes pinning the pool).
    assert "CPU pool + disk tier: pool hits " in out.stdout
    for figure in ("peak pool blocks pinned", "writes skipped", "DISK blocks written",
                   "DISK timeouts", "DISK breaker"):  # fmt: skip
        assert figure in out.stdout, figure


def conversation_trace(path: Path, conversations: int = 16, turns: int = 4) -> Path:
    """A trace in the Mooncake format shaped like the shared one (a checkout in CI has
    no ``shared/`` beside it): one system-prompt block, then each conversation's own
    id (``hash_ids[1]``), each turn extending the previous turn's blocks."""
    lines = []
    for turn in range(turns):
        for c in range(conversations):
            ids = [0, 1 + c] + [1000 * (1 + c) + i for i in range(3 * (turn + 1))]
            lines.append(json.dumps({"timestamp": 1000 * turn + c, "input_length": 512 * len(ids),
                                     "output_length": 100, "hash_ids": ids}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_agentic_quick_replays_every_mode_and_the_stall(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A real disk tier under tmp_path; the pool is too small for the slice, so the
    # loads and prefetches read from disk. Timings are printed, never checked.
    trace = conversation_trace(tmp_path_factory.mktemp("trace") / "trace.jsonl")
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_agentic.py", "--quick", "--dir", str(tmp_path),
         "--trace", str(trace)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")
        for line in out.stdout.splitlines()
        if line.startswith("| ") and "wait" not in line
    }
    for mode in ("none", "prefetch", "demote+prefetch", "retain"):
        assert mode in rows, mode
    assert float(rows["none"][9]) > 0  # tier blocks read: the disk served hits
    assert "stalls fired 1 (without: 0)" in out.stdout  # the stall was injected, once
    assert out.stdout.count("target: ") == 2
    assert list(tmp_path.iterdir()) == []  # every tier directory removed
