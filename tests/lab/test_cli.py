"""``aiokvo replay`` end to end, on small traces written in ``tmp_path``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiokvo.lab.belady import belady_hits
from aiokvo.manager.policies import BUILTIN_POLICIES
from aiokvo.telemetry import cli
from tests.lab._traces import conversation_trace, write_trace

FIELDS = {"policy", "capacity_fraction", "capacity_blocks", "hit_rate", "belady_hit_rate"}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "trace.jsonl", conversation_trace(11, 400))


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(["replay", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_json_has_one_line_per_policy_and_capacity(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run(capsys, str(trace), "--policy", "all", "--capacity", "0.05", "0.5",
                         "--json")  # fmt: skip
    assert status == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["policy"], r["capacity_fraction"]) for r in rows] == [
        (policy, fraction) for fraction in (0.05, 0.5) for policy in BUILTIN_POLICIES
    ]
    requests = conversation_trace(11, 400)
    distinct = len({b for r in requests for b in r})
    for row in rows:
        assert row.keys() >= FIELDS
        assert row["capacity_blocks"] == round(row["capacity_fraction"] * distinct)
        bound = belady_hits(requests, row["capacity_blocks"]).hit_rate
        assert row["belady_hit_rate"] == pytest.approx(bound, abs=1e-6)
        assert 0 <= row["hit_rate"] <= row["belady_hit_rate"]
        assert row["references"] == sum(map(len, requests))
    bigger = {r["policy"]: r["hit_rate"] for r in rows if r["capacity_fraction"] == 0.5}
    smaller = {r["policy"]: r["hit_rate"] for r in rows if r["capacity_fraction"] == 0.05}
    assert all(bigger[p] >= smaller[p] for p in ("lru", "chain"))


def test_the_table_names_every_policy_and_bytes_and_tiers_show_in_json(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run(capsys, str(trace), "--policy", "lru", "chain", "--capacity", "0.1")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["policy", "capacity", "blocks"]
    assert [line.split()[0] for line in lines[1:]] == ["lru", "chain"]
    status, out, _ = run(capsys, str(trace), "--policy", "lru", "--capacity", "0.05", "--json",
                         "--tiers", "disk=0.5", "--block-bytes", "1000")  # fmt: skip
    assert status == 0
    (row,) = [json.loads(line) for line in out.splitlines()]
    (disk,) = row["tiers"]
    assert disk["name"] == "DISK" and disk["blocks_written"] > 0
    assert disk["bytes_written"] == 1000 * disk["blocks_written"]
    assert row["bytes_from_pool"] == 1000 * row["hits"]


def test_plot_writes_a_png(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "curves.png"
    status, _, err = run(capsys, str(trace), "--policy", "lru", "chain", "--capacity", "0.05",
                         "0.2", "--plot", str(picture), "--json")  # fmt: skip
    assert status == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(picture) in err


def test_plot_without_matplotlib_names_the_extra_before_replaying(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "matplotlib" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    status, out, err = run(capsys, str(trace), "--plot", str(tmp_path / "x.png"))
    assert status == 2
    assert "aiokvo[lab]" in err
    assert out == ""  # nothing was replayed
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--policy", "nope"], "nope"),
        (["--capacity", "0"], "(0, 1]"),
        (["--tiers", "disk"], "NAME=SHARE"),
        (["--block-bytes", "0"], "--block-bytes"),
    ],
)
def test_bad_options_are_named(
    trace: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    status, out, err = run(capsys, str(trace), *args)
    assert status == 2
    assert says in err and out == ""


def test_a_bad_trace_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1]}\n{"hash_ids": "x"}\n')
    status, _, err = run(capsys, str(bad))
    assert status == 2
    assert "bad.jsonl:2" in err


@pytest.mark.system
def test_the_installed_command_runs_with_a_progress_bar(trace: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aiokvo.telemetry", "replay", str(trace), "--policy", "sieve",
         "--capacity", "0.1", "--json", "--progress"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert row["policy"] == "sieve"
    assert b"\r" in proc.stderr and b"100%" in proc.stderr
