"""``aiokvo disk ls`` / ``aiokvo disk prune``: a root's layouts by the tier's own ownership rules.

Real tiers write real slabs under one root: a closed one (its model gone) and a
live one (its slab lock held, here by this very process: flock locks belong to
each open file, so the listing's own open cannot take it).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from aiokvo import Offloader
from aiokvo.errors import ConfigError, UnsafeFileError
from aiokvo.telemetry.cli import main
from aiokvo.tiers.disk.admin import list_layouts, prune_layouts
from aiokvo.tiers.disk.cli import run_disk
from tests.tiers.disk._util import KV, disk_tier, fill, keys


async def _write(root: Path, model: str, n: int) -> None:
    kv = KV()
    tier = disk_tier(root, kv=kv, model_id=model)
    async with Offloader(kv.config(16), kv.caches, tiers=[tier]) as off:
        await fill(off, kv, keys(model, n))
        await off.drain()


async def test_ls_lists_each_layout_with_its_blocks_bytes_and_writers(
    disk_tier_path: Path,
) -> None:
    await _write(disk_tier_path, "old-model", 3)
    kv = KV()
    live = disk_tier(disk_tier_path, kv=kv, model_id="new-model")
    async with Offloader(kv.config(16), kv.caches, tiers=[live]) as off:
        await fill(off, kv, keys("new", 5))
        await off.drain()
        layouts, skipped = list_layouts(disk_tier_path)
        assert skipped == []
        by_live = {layout.live: layout for layout in layouts}
        assert set(by_live) == {True, False}
        assert by_live[False].blocks == 3 and by_live[True].blocks == 5
        assert by_live[True].writers == (os.getpid(),) and by_live[False].writers == ()
        assert all(layout.disk_bytes >= layout.blocks * kv.slot_bytes() for layout in layouts)
        assert by_live[True].path == live.store.directory  # type: ignore[attr-defined]
        out = io.StringIO()
        assert main_ls(disk_tier_path, out, json_rows=True) == 0
        rows = [json.loads(line) for line in out.getvalue().splitlines()]
        assert sorted(r["blocks"] for r in rows) == [3, 5]
        assert {r["layout"] for r in rows} == {layout.name for layout in layouts}


def main_ls(root: Path, out: io.StringIO, *, json_rows: bool = False) -> int:
    import argparse

    return run_disk(argparse.Namespace(disk_command="ls", root=str(root), json=json_rows), out)


async def test_prune_removes_only_what_no_process_writes(disk_tier_path: Path) -> None:
    await _write(disk_tier_path, "gone-a", 2)
    await _write(disk_tier_path, "gone-b", 2)
    kv = KV()
    live = disk_tier(disk_tier_path, kv=kv, model_id="serving")
    async with Offloader(kv.config(16), kv.caches, tiers=[live]) as off:
        ks = keys("serving", 4)
        await fill(off, kv, ks)
        await off.drain()
        would, _ = prune_layouts(disk_tier_path, dry_run=True)
        assert len(would) == 2 and all(layout.path.exists() for layout in would)
        removed, skipped = prune_layouts(disk_tier_path)
        assert sorted(layout.name for layout in removed) == sorted(w.name for w in would)
        assert not any(layout.path.exists() for layout in removed)
        assert [s.reason for s in skipped] == [f"in use by pid [{os.getpid()}]"]
        left, _ = list_layouts(disk_tier_path)
        assert [layout.live for layout in left] == [True]
        kv.clear(range(4))
        assert await off.load_prefix(ks, [0, 1, 2, 3]) == 4  # the live tier serves on
    assert sorted(os.listdir(disk_tier_path)) == [left[0].name]  # nothing left behind


async def test_what_is_not_ours_or_not_a_layout_is_skipped_and_never_removed(
    disk_tier_path: Path, tmp_path: Path
) -> None:
    await _write(disk_tier_path, "m", 1)
    (layout,) = list_layouts(disk_tier_path)[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, disk_tier_path / ("v1-" + "ab" * 16))
    loose = disk_tier_path / ("v1-" + "cd" * 16)
    loose.mkdir(mode=0o755)
    (layout.path / "notes.txt").write_text("operator's file")
    removed, skipped = prune_layouts(disk_tier_path)
    assert removed == []
    reasons = {s.path.name: s.reason for s in skipped}
    assert reasons[layout.name].startswith("holds 'notes.txt'")
    assert reasons["v1-" + "ab" * 16] == "a symbolic link"
    assert "not owner-only" in reasons["v1-" + "cd" * 16]
    assert elsewhere.exists() and (layout.path / "notes.txt").exists() and loose.exists()


def test_a_root_that_is_missing_or_a_link_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        list_layouts(tmp_path / "missing")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        prune_layouts(tmp_path / "link")
    assert main(["disk", "ls", str(tmp_path / "missing")]) == 2
