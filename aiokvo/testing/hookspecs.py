"""Hooks the aiokvo pytest plugin offers (implement them in a ``conftest.py``)."""

from __future__ import annotations

import pytest

from aiokvo.testing.gpu import GpuInventory


@pytest.hookspec(firstresult=True)
def pytest_aiokvo_gpus(config: pytest.Config) -> GpuInventory | None:
    """The CUDA devices GPU markers are checked against (first non-None answer wins).

    The plugin's own answer probes in a child process (see
    :mod:`aiokvo.testing.gpu`); a conftest can answer instead, for a
    scheduler that already knows, or to test skip logic without GPUs.
    """
    return None
