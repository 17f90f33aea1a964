"""The fast lane's guard (tests/conftest.py): a test that starts a process says so."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.conftest import UnmarkedSystemTest


def test_an_unmarked_test_cannot_start_a_process() -> None:
    named = r"test_lanes\.py::\S+ starts a process .* mark it @pytest\.mark\.system"
    with pytest.raises(UnmarkedSystemTest, match=named):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


async def test_nor_through_asyncio() -> None:
    with pytest.raises(UnmarkedSystemTest, match="asyncio"):
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")


@pytest.mark.system
async def test_a_system_test_can() -> None:
    assert subprocess.run([sys.executable, "-c", "pass"], check=True).returncode == 0
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    assert await proc.wait() == 0
