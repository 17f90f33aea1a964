"""Suite-wide fixtures: every async test runs on uvloop (and the stdlib loop
where a test asks for both), and GPU tests skip cleanly without a device."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a declared dependency
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """uvloop for every async test; tests marked ``both_loops`` also get asyncio."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    if uvloop is None or item.get_closest_marker("both_loops") is not None:
        factories["asyncio"] = asyncio.new_event_loop
    return factories


def _cuda_device_count() -> int:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return 0
    err, count = runtime.cudaGetDeviceCount()
    return int(count) if int(err) == 0 else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and _cuda_device_count() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
