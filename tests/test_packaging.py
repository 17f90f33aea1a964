"""What a packager and a first-time user meet: the version, the license, the metadata, the
README as the package index shows it, and the extras' messages."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import aiokvo
from aiokvo.telemetry import cli

ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_prints_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"aiokvo {aiokvo.__version__}"


def test_the_version_is_the_installed_distributions() -> None:
    import importlib.metadata

    assert importlib.metadata.version("aiokvo") == aiokvo.__version__
