import asyncio

import pytest


async def test_async_tests_run_on_uvloop() -> None:
    loop = asyncio.get_running_loop()
    assert type(loop).__module__.startswith("uvloop")


@pytest.mark.both_loops
async def test_both_loops_marker_adds_stdlib_loop(request: pytest.FixtureRequest) -> None:
    loop = asyncio.get_running_loop()
    assert type(loop).__module__.startswith(("uvloop", "asyncio"))
