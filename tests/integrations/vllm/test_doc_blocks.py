"""docs/vllm.md's block runs with vLLM (its glue: tests/docs/blocks.py), here in the vLLM venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import GLUE, blocks, glue_of, program


@pytest.mark.system  # each block runs in a child interpreter
def test_the_vllm_blocks_run(tmp_path: Path) -> None:
    found = [b for b in blocks() if GLUE[glue_of(b)[0]].kind == "vllm"]
    assert found
    for block in found:
        path = tmp_path / f"{block.name}.py"
        path.write_text(program(block, GLUE[glue_of(block)[0]], {"tmp": str(tmp_path)}))
        out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-4000:]
