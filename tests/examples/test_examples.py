"""The examples run and check what they claim (the README's demo is ``make demo``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from aiokvo.handlers.host import HostCopy, apply_host_copies

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"aiokvo_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while executing
    spec.loader.exec_module(module)
    return module


def test_telemetry_example_serves_metrics_that_match_statistics(
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = _load("telemetry")
    # Two per-second lines need the run to outlast the second tick: 3 s leaves that
    # tick a second of slack on a loaded machine (2.2 s left it 0.2 s).
    assert module.main(["--seconds", "3", "--pool-blocks", "16"]) == 0
    out = capsys.readouterr().out
    assert "metrics at http://127.0.0.1:" in out
    per_second = [line for line in out.splitlines() if line.startswith("CPU ")]
    assert len(per_second) >= 2  # one line a second, from the package's aggregation
    assert all("pool 16/16 blocks (100.0%)" in line for line in per_second)  # kept full
    final = out.split("final:")[1]
    assert int(final.split("stored")[1].split()[0]) > 0
    assert int(final.split("evicted")[1].split()[0]) > 0
    assert "scraped metrics match statistics()" in out  # the HTTP scrape, read back


# -- the demo (make demo) ------------------------------------------------------------


# Few prefixes: plenty of reloads in every run, whatever the timing.
DEMO_ARGS = ["--requests", "60", "--prefixes", "4", "--layers", "2", "--gpu-blocks", "96",
             "--cpu-blocks", "48", "--kv-heads", "2", "--head-dim", "64"]  # fmt: skip


@pytest.mark.parametrize("concurrency", [1, 8, 32, 128])
def test_quickstart_demo_verifies_every_reload(
    capsys: pytest.CaptureFixture[str], concurrency: int
) -> None:
    demo = _load("quickstart")
    assert demo.main([*DEMO_ARGS, "--concurrency", str(concurrency)]) == 0
    out = capsys.readouterr().out
    loaded = int(out.split("blocks loaded")[1].split()[0])
    assert loaded > 0
    assert f"verified          {loaded}/{loaded}" in out
    assert "requests          60 in" in out
    assert f"({concurrency} in flight)" in out
    assert int(out.split("blocks evicted")[1].split()[0]) > 0  # the pool was too small
    assert "failed transfers  0" in out


def test_quickstart_demo_reports_hits_per_tier(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    demo = _load("quickstart")
    root = tmp_path / "disk"
    args = [*DEMO_ARGS, "--cpu-blocks", "32", "--concurrency", "1", "--disk-dir", str(root)]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    disk_hits = int(out.split("hits by tier")[1].split("DISK")[1].split()[0])
    assert disk_hits > 0  # blocks the small pool evicted came back from disk
    assert "0 checksum failures, breaker closed" in out
    loaded = int(out.split("blocks loaded")[1].split()[0])
    assert f"verified          {loaded}/{loaded}" in out
    assert any(root.iterdir())  # the tier's directory, left for the next run
    assert demo.main([*args, "--no-disk"]) == 0
    off = capsys.readouterr().out
    assert "DISK" not in off.split("hits by tier")[1].splitlines()[0]


def test_quickstart_demo_exits_non_zero_on_corrupt_reload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def corrupting(copies: Sequence[HostCopy]) -> None:
        apply_host_copies(copies)
        for copy in copies:  # damage the first page written by every copy
            if copy.dst_rows.size:
                row = int(copy.dst_rows[0])
                page = copy.dst[row : row + 1].view(np.uint8).reshape(-1)  # either page view
                page[0] = (int(page[0]) + 1) % 256  # not an involution: stays wrong on reload

    demo = _load("quickstart")
    assert demo.main([*DEMO_ARGS, "--concurrency", "8"], copy_fn=corrupting) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    assert int(out.split("FAILED: ")[1].split()[0]) > 0  # mismatches were counted


def _mooncake_hits(block: str) -> int:
    return int(block.split("hits by tier")[1].split("MOONCAKE")[1].split()[0])


@pytest.mark.system
def test_quickstart_demo_starts_a_local_mooncake_cluster_shared_by_replicas(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from aiokvo.testing.mooncake import require_mooncake

    require_mooncake()
    demo = _load("quickstart")
    args = [*DEMO_ARGS, "--cpu-blocks", "32", "--concurrency", "2", "--disk-dir", str(tmp_path),
            "--mooncake", "local", "--mooncake-segment-mib", "64", "--replicas", "2"]  # fmt: skip
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "started a local Mooncake cluster" in out
    first, second = out.split("replica 0:")[1].split("replica 1:")
    # A prefix one replica computed is a Mooncake hit for the other.
    assert _mooncake_hits(first) + _mooncake_hits(second) > 0
    for block in (first, second):
        loaded = int(block.split("blocks loaded")[1].split()[0])
        assert f"verified          {loaded}/{loaded}" in block
        assert "mooncake tier" in block and "breaker closed" in block


@pytest.mark.system
def test_quickstart_demo_uses_a_running_mooncake_cluster(
    capsys: pytest.CaptureFixture[str], mooncake_cluster: object
) -> None:
    cluster = mooncake_cluster(1, segment_size=64 << 20)  # type: ignore[operator]
    demo = _load("quickstart")
    # One request at a time: a pool of 16 blocks has room for every promotion.
    args = [*DEMO_ARGS, "--cpu-blocks", "16", "--concurrency", "1", "--no-disk",
            "--mooncake", cluster.master_server_addr]  # fmt: skip
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert _mooncake_hits(out) > 0  # what the small pool evicted came back from the cluster
    loaded = int(out.split("blocks loaded")[1].split()[0])
    assert f"verified          {loaded}/{loaded}" in out
    assert len(cluster.keys()) > 0
