"""The runnable code blocks of docs/offloader.md run as written (as the README's does)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "offloader.md"
BLOCKS = [
    block
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    if "aiokvo.run(" in block
]


def test_the_page_has_runnable_blocks() -> None:
    assert BLOCKS


@pytest.mark.system
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.splitlines()[-1][:40])
def test_block_runs(block: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if "class ByHand" in block:  # the manual-control pattern, which checks its bytes
        assert "by hand: stored and reloaded 3 blocks" in out.stdout
