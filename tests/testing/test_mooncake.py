"""The plugin's mooncake_cluster fixture, run as a user's suite would run it (pytester)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aiokvo.testing.mooncake import missing_mooncake, require_mooncake

pytest_plugins = ["pytester"]

USES_A_CLUSTER = """
def test_cluster(mooncake_cluster):
    cluster = mooncake_cluster(2, segment_size=16 << 20)
    print("PIDS", cluster.master.pid, *(n.pid for n in cluster.nodes))
    assert sorted(cluster.segments()) == sorted(n.name for n in cluster.nodes)
    assert cluster.master_server_addr.startswith("127.0.0.1:")
"""


@pytest.mark.system
def test_the_fixture_starts_a_cluster_and_stops_every_process_by_pid(
    pytester: pytest.Pytester,
) -> None:
    require_mooncake()
    pytester.makepyfile(USES_A_CLUSTER)
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=1)
    (line,) = [x for x in result.outlines if "PIDS" in x]
    pids = [int(p) for p in line.split("PIDS", 1)[1].split()[:3]]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture
def without_mooncake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner runs see a ``mooncake`` package whose ``store`` cannot be imported."""
    fake = tmp_path / "shadow" / "mooncake"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "store.py").write_text("raise ImportError('libibverbs.so.1: cannot open')\n")
    paths = [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("AIOKVO_REQUIRE_MOONCAKE", raising=False)


@pytest.mark.system
@pytest.mark.usefixtures("without_mooncake")
def test_without_mooncake_the_test_is_skipped_saying_what_is_missing(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(USES_A_CLUSTER)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*a Mooncake cluster needs a working mooncake.store*libibverbs*"])


@pytest.mark.system
@pytest.mark.usefixtures("without_mooncake")
def test_on_ci_a_missing_mooncake_fails_instead(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    pytester.makepyfile(USES_A_CLUSTER)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*a Mooncake cluster needs*(required: CI=true*"])


def test_here_nothing_is_missing_or_the_reason_names_it() -> None:
    missing = missing_mooncake()
    assert all(isinstance(m, str) and m for m in missing)
    if os.environ.get("CI", "").lower() == "true":
        assert missing == [], missing  # CI installs everything: `make test` does it
