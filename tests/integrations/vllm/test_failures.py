"""The store-failure file: a worker's failed blocks reach the manager in another process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from aiokvo.errors import ConfigError, UnsafeFileError
from aiokvo.integrations.vllm.failures import FailureLog, StoreFailures, failure_log_path

ROOT = Path(__file__).resolve().parents[3]


def private_dir(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    return d


@pytest.mark.system  # the writer is another process
def test_blocks_written_by_another_process_are_read_once(tmp_path: Path) -> None:
    path = failure_log_path(private_dir(tmp_path), "engine-x", 0)
    owner = FailureLog(path, 64, owner=True)
    assert owner.read_new() == []
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    code = (
        "import sys; from pathlib import Path;"
        "from aiokvo.integrations.vllm.failures import FailureLog;"
        "log = FailureLog(Path(sys.argv[1]), 64); log.append([5, 9, 11]); log.append([2]);"
        "log.close()"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=env, timeout=120)
    assert owner.read_new() == [5, 9, 11, 2]
    assert owner.read_new() == []  # each record once
    owner.close()
    assert not path.exists()  # the owner removes its file


def test_the_ring_wraps_and_counts_records_it_lost(tmp_path: Path) -> None:
    path = failure_log_path(private_dir(tmp_path), "engine-y", 1)
    owner = FailureLog(path, 4, owner=True)
    writer = FailureLog(path, 4)
    writer.append([1, 2, 3])
    assert owner.read_new() == [1, 2, 3]
    writer.append([4, 5, 6])  # wraps past the end of the ring
    assert owner.read_new() == [4, 5, 6]
    writer.append([7, 8, 9, 10, 11, 12])  # more than the ring holds before a read
    assert owner.read_new() == [9, 10, 11, 12] and owner.lost == 2
    writer.close()
    owner.close()


def test_store_failures_polls_every_rank(tmp_path: Path) -> None:
    d = private_dir(tmp_path)
    logs = [FailureLog(failure_log_path(d, "e", r), 8, owner=True) for r in range(2)]
    failures = StoreFailures(logs)
    assert not failures.poll()
    FailureLog(failure_log_path(d, "e", 1), 8).append([3])
    assert failures.poll()
    failures.clear()
    assert not failures.poll()
    failures.close()
    assert not any(d.iterdir())


def test_a_planted_link_or_a_mismatched_file_is_refused(tmp_path: Path) -> None:
    d = private_dir(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = failure_log_path(d, "z", 0)
    link.symlink_to(target)
    with pytest.raises(UnsafeFileError):
        FailureLog(link, 8).append([1])
    owner = FailureLog(failure_log_path(d, "w", 0), 8, owner=True)
    with pytest.raises(ConfigError, match="another engine"):
        FailureLog(failure_log_path(d, "w", 0), 16).append([1])
    owner.close()
    odd = failure_log_path(d, "a/b c", 0)
    assert odd.parent == d and "/" not in odd.name[len("vllm-store-failures-"):]
