"""What works in prometheus-client's multiprocess mode (docs/telemetry.md claims it).

Custom collectors are not written to the multiprocess files, so one process's
aiokvo metrics never reach another's ``MultiProcessCollector``. What works,
checked here with two real processes: each process serving its own aiokvo
metrics, and a process registering its ``OffloadMetrics`` next to a
``MultiProcessCollector`` (it reports that process's Offloader only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


def start(role: str, hits: int, mp_dir: Path) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.telemetry.multiprocess_app", role, str(hits)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"{role} did not start (exit {proc.poll()})"
    return proc, int(line)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_process_serves_its_own_and_a_front_merges_only_plain_metrics(
    tmp_path: Path,
) -> None:
    engine, engine_port = start("engine", 3, tmp_path)
    try:
        front, front_port = start("front", 2, tmp_path)
        try:
            at_front = scrape(front_port)
            at_engine = scrape(engine_port)
        finally:
            assert front.stdin is not None
            front.stdin.close()
            assert front.wait(60) == 0
    finally:
        assert engine.stdin is not None
        engine.stdin.close()
        assert engine.wait(60) == 0
    cpu = frozenset({("medium", "CPU")})
    # Ordinary metrics of both processes are merged at the front...
    assert at_front[("app_requests_total", frozenset({("role", "engine")}))] == 3
    assert at_front[("app_requests_total", frozenset({("role", "front")}))] == 2
    # ...but its aiokvo metrics are its own Offloader's: the engine's are not merged in.
    assert at_front[("aiokvo_hit_blocks_total", cpu)] == 2
    assert at_front[("aiokvo_miss_blocks_total", cpu)] == 1
    # The engine's own metrics server reports the engine's Offloader.
    assert at_engine[("aiokvo_hit_blocks_total", cpu)] == 3
    assert at_engine[("aiokvo_stored_blocks_total", cpu)] == 3
