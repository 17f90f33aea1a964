"""README.md's and docs/*.md's code blocks run, and type-check with ``mypy --strict``.

Each fenced ``python`` block runs with the glue written next to the others in
:mod:`tests.docs.blocks`: programs in a fresh interpreter, pytest examples in
a fresh temporary project (pytester, in a subprocess) whose ini file holds
only what the docs tell a user to put there. The ini blocks of
docs/testing.md run verbatim. Blocks that need vLLM run in the vLLM venv
(tests/integrations/vllm/test_doc_blocks.py).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.blocks import (
    GLUE,
    LOOP_REPORT,
    ROOT,
    Block,
    Glue,
    blocks,
    fill,
    foreign_addresses,
    glue_of,
    program,
)

pytest_plugins = ["pytester"]

BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if GLUE[glue_of(b)[0]].kind == "script"]
PYTESTS = [b for b in BLOCKS if GLUE[glue_of(b)[0]].kind == "pytest"]


def _id(block: Block) -> str:
    return f"{block.page}:{block.line}"


def glue(block: Block) -> Glue:
    return GLUE[glue_of(block)[0]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def tokens(tmp_path: Path) -> dict[str, str]:
    return {"tmp": str(tmp_path), "port0": str(free_port()), "port1": str(free_port())}


@pytest.fixture
def cluster_env(
    request: pytest.FixtureRequest, tokens: dict[str, str], tmp_path: Path
) -> Iterator[dict[str, str]]:
    """A loopback Mooncake cluster for the blocks that name a master (P2P metadata,
    as the docs' tiers use by default); the environment its clients need."""
    block: Block = request.param
    if "mooncake" not in glue(block).needs:
        yield {}
        return
    from aiokvo.testing.mooncake import require_mooncake

    require_mooncake()  # skips naming what is missing (fails on CI)
    from aiokvo.testing.mooncake_cluster import LocalCluster

    workdir = tmp_path / "cluster"
    workdir.mkdir(mode=0o700)
    with LocalCluster(1, workdir=workdir, metadata="p2p") as cluster:
        tokens["mooncake_master"] = cluster.master_server_addr
        yield dict(cluster.client_env)


# -- every block is glued, and what runs stays on loopback ---------------------------------


def test_every_block_has_its_glue_and_every_glue_its_block() -> None:
    assert len(BLOCKS) >= 28
    for block in BLOCKS:
        assert len(glue_of(block)) == 1, f"{_id(block)} ({block.first_line!r}): {glue_of(block)}"
    used = {k for b in BLOCKS for k in glue_of(b)}
    assert set(GLUE) == used, f"glue without a block: {set(GLUE) - used}"


@pytest.mark.parametrize("block", BLOCKS, ids=_id)
def test_no_program_reaches_beyond_loopback(block: Block) -> None:
    tokens = {"tmp": "/tmp/x", "port0": "1", "port1": "2", "mooncake_master": "127.0.0.1:3"}
    g = glue(block)
    code = program(block, g, tokens) + "".join(fill(f, tokens) for f in g.files.values())
    assert foreign_addresses(code) == []


def test_the_loopback_check_would_catch_the_docs_addresses() -> None:
    assert foreign_addresses('MooncakeTier("10.0.0.5:50051")') == ["10.0.0.5"]
    assert foreign_addresses('KVEventPublisher(m, "tcp://*:5557")') == ["tcp://*:5557"]
    assert foreign_addresses('"http://host:9400/metrics"') == ["host"]
    assert foreign_addresses('"tcp://127.0.0.1:5557" "http://127.0.0.1:9400"') == []


# -- programs -------------------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize(
    ("block", "cluster_env"), [(b, b) for b in RUNNABLE], ids=_id, indirect=["cluster_env"]
)
def test_the_block_runs(
    block: Block, cluster_env: dict[str, str], tokens: dict[str, str], tmp_path: Path
) -> None:
    g = glue(block)
    path = tmp_path / f"{block.name}.py"
    path.write_text(program(block, g, tokens))
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path,
        timeout=300, env={**os.environ, **cluster_env},
    )  # fmt: skip
    assert out.returncode == 0, f"{path.read_text()}\n---\n{out.stderr[-4000:]}"
    if g.stdout:
        assert g.stdout in out.stdout


# -- pytest examples, each in a fresh project ------------------------------------------------


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    return {k: v for k, v in result.parseoutcomes().items() if k in (
        "passed", "skipped", "failed", "errors", "xfailed", "xpassed")}


@pytest.mark.system
@pytest.mark.parametrize(
    ("block", "cluster_env"), [(b, b) for b in PYTESTS], ids=_id, indirect=["cluster_env"]
)
def test_the_pytest_example_runs_in_a_fresh_project(
    block: Block, cluster_env: dict[str, str], tokens: dict[str, str],
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """No ini file but what a user would write anyway: pytest-asyncio's strict mode."""
    g = glue(block)
    for name, value in cluster_env.items():
        monkeypatch.setenv(name, value)
    code = program(block, g, tokens)
    pytester.makefile(".py", **{g.as_file.removesuffix(".py"): code})
    for name, content in g.files.items():
        text = fill(content.replace("{block}", block.code), tokens)
        pytester.makefile(Path(name).suffix, **{Path(name).stem: text})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs",
                                           "-W", "ignore::pytest.PytestAssertRewriteWarning")
    outcomes = _outcomes(result)
    assert not outcomes.get("failed") and not outcomes.get("errors"), result.stdout.str()
    if g.expect is not None:
        assert outcomes == g.expect, result.stdout.str()
    else:
        assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) >= 1, result.stdout.str()


@pytest.mark.system
def test_the_readmes_gpu_example_skips_without_the_gpus_it_names(
    pytester: pytest.Pytester,
) -> None:
    """The README's example in a project without GPUs: two pass, the two-GPU one skips
    with the plugin's reason (a conftest answers the inventory, as docs/testing.md shows)."""
    block = next(b for b in BLOCKS if b.page == "README.md" and "test_two_ranks" in b.code)
    pytester.makepyfile(test_readme=block.code, my_project=glue(block).files["my_project.py"])
    pytester.makeconftest("""
        from aiokvo.testing.gpu import GpuInventory

        def pytest_aiokvo_gpus(config):
            return GpuInventory(())
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    assert _outcomes(result) == {"passed": 2, "skipped": 1}, result.stdout.str()
    result.stdout.fnmatch_lines(["*needs 2 CUDA devices with >= 40 GiB, found none*"])


def _ini_blocks() -> list[str]:
    text = (ROOT / "docs" / "testing.md").read_text()
    return re.findall(r"^```ini\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.system
def test_the_ini_block_runs_as_written(pytester: pytest.Pytester) -> None:
    """Copied verbatim, comment and all, it used to stop the session
    (``aiokvo_loop_factories: unknown event loop '#'``)."""
    (ini,) = _ini_blocks()
    assert "# opt in" in ini
    pytester.makefile(".ini", pytest=ini)
    pytester.makepyfile(test_loops=LOOP_REPORT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-v")
    assert _outcomes(result) == {"passed": 2}, result.stdout.str()
    result.stdout.fnmatch_lines_random(["*LOOP uvloop*", "*LOOP asyncio*"])


# -- mypy --strict ---------------------------------------------------------------------------


def test_the_blocks_type_check_with_mypy_strict(tmp_path: Path) -> None:
    """Every program, pytest example and vLLM block as it runs, glue included."""
    from mypy import api

    tokens = {"tmp": "/tmp/aiokvo-doc", "port0": "1", "port1": "2",
              "mooncake_master": "127.0.0.1:3"}
    written = []
    for block in BLOCKS:
        g = glue(block)
        path = tmp_path / f"{block.name}.py"
        path.write_text(program(block, g, tokens))
        written.append(path)
        for name, content in g.files.items():
            text = fill(content.replace("{block}", block.code), tokens)
            if name == "conftest.py":  # one per example: checked under its own name
                conf = tmp_path / f"{block.name}_conftest.py"
                conf.write_text(text)
                written.append(conf)
            elif name.endswith(".py"):  # my_project.py: the same for every example
                (tmp_path / name).write_text(text)
    stdout, stderr, status = api.run([
        "--strict", "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(ROOT / ".mypy_cache"),
        *map(str, written),
    ])
    assert status == 0, stdout + stderr


# -- names the prose mentions -----------------------------------------------------------------

PLACEHOLDERS = {"SomeHandler"}  # docs/async.md: "per handler: SomeHandler(..., poller_mode=...)"


def _defined_names() -> set[str]:
    import importlib
    import pkgutil

    import aiokvo

    names: set[str] = set()
    for info in pkgutil.walk_packages(aiokvo.__path__, "aiokvo."):
        if info.name.startswith("aiokvo.integrations.vllm") or info.name.endswith("__main__"):
            continue  # vLLM's venv checks those
        names.update(vars(importlib.import_module(info.name)))
    return names


def _resolves(path: str) -> bool:
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attribute in parts[i:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_the_docs_name_only_what_exists() -> None:
    """docs/layout-and-plans.md described a ``Telemetry(manager, worker)`` class long after
    it was gone: every ``Name(`` and ``aiokvo.dotted.path`` the pages show must exist."""
    text = "".join(page.read_text() for page in (ROOT / "README.md",
                                                  *sorted((ROOT / "docs").glob("*.md"))))
    defined = _defined_names()
    called = set(re.findall(r"`([A-Z][A-Za-z0-9_]*)\(", text))
    assert sorted(called - defined - PLACEHOLDERS) == []
    dotted = {p for p in re.findall(r"`(aiokvo(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text)
              if not p.startswith("aiokvo.integrations.vllm")}
    assert sorted(p for p in dotted if not _resolves(p)) == []
