"""aiokvo's pytest plugin, run as a user's suite would run it (pytester)."""

from __future__ import annotations

import pytest

# Imported here, before any in-process inner run: pytester restores sys.modules
# after each run, and torch's C extension cannot be imported a second time.
import torch

from aiokvo.testing.gpu import probe_gpus

pytest_plugins = ["pytester"]

ASYNC_INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
filterwarnings = ignore::pytest.PytestAssertRewriteWarning
{extra}
"""


@pytest.fixture(autouse=True)
def _default_ini(pytester: pytest.Pytester) -> None:
    """Every inner run is configured; a test may overwrite this with its own."""
    pytester.makeini(ASYNC_INI.format(extra=""))

LOOP_REPORT = """
import asyncio

async def test_loop():
    print("LOOP", type(asyncio.get_running_loop()).__module__)
"""

TWO_GPUS_CONFTEST = """
from aiokvo.testing.gpu import GIB, GpuInfo, GpuInventory

def pytest_aiokvo_gpus(config):
    return GpuInventory((GpuInfo(0, "fake", 16 * GIB), GpuInfo(1, "fake", 16 * GIB)))
"""


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines([
        "@pytest.mark.aiokvo_gpu(n=1):*", "@pytest.mark.aiokvo_multi_gpu(n=2):*",
        "@pytest.mark.aiokvo_min_gpu_memory(gib):*", "@pytest.mark.aiokvo_both_loops:*",
    ])
    result.stdout.no_fnmatch_line("@pytest.mark.gpu(n=1):*")  # no short names by default


@pytest.mark.system
def test_gpu_tests_run_or_skip_by_what_the_probe_finds(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.aiokvo_gpu
        def test_needs_a_gpu():
            pass
    """)
    result = pytester.runpytest("-rs")
    if probe_gpus().devices:
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(skipped=1)
        result.stdout.fnmatch_lines(["*needs a CUDA device, found none*"])


def test_requirements_are_checked_against_the_inventory(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TWO_GPUS_CONFTEST)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.aiokvo_gpu
        def test_one(): pass

        @pytest.mark.aiokvo_gpu(2)
        def test_two(): pass

        @pytest.mark.aiokvo_multi_gpu
        @pytest.mark.aiokvo_min_gpu_memory(8)
        def test_two_of_8_gib(): pass

        @pytest.mark.aiokvo_gpu(3)
        def test_three(): pass

        @pytest.mark.aiokvo_min_gpu_memory(24)
        def test_big(): pass

        @pytest.mark.aiokvo_gpu
        class TestGroup:
            @pytest.mark.aiokvo_multi_gpu(4)
            def test_four(self): pass
    """)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=3, skipped=3)
    result.stdout.fnmatch_lines_random([
        "*needs 3 CUDA devices, found 2",
        "*needs a CUDA device with >= 24 GiB, found 0 (largest 16.0 GiB)",
        "*needs 4 CUDA devices, found 2",
    ])


def test_a_bad_marker_argument_stops_the_session_with_its_name(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(TWO_GPUS_CONFTEST)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.aiokvo_gpu("two")
        def test_bad(): pass
    """)
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_bad: @pytest.mark.aiokvo_gpu count must be an int >= 1, "
                                 "got 'two'*"])


def test_no_gpu_marker_means_no_probe(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
        def pytest_aiokvo_gpus(config):
            raise AssertionError("probed without a GPU test")
    """)
    pytester.makepyfile("def test_plain(): pass")
    pytester.runpytest().assert_outcomes(passed=1)


@pytest.mark.system
def test_deciding_skips_loads_neither_torch_nor_cuda(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import sys
        import pytest

        @pytest.mark.aiokvo_gpu
        def test_gpu(): pass

        def test_nothing_loaded():
            loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cuda"))
            assert loaded == []
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 1 and "failed" not in outcomes, result.stdout.str()


def test_loops_are_left_alone_unless_the_project_opts_in(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LOOP_REPORT)
    result = pytester.runpytest("-s", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*LOOP asyncio*"])
    result.stdout.no_fnmatch_line("*aiokvo: async tests run on*")


def test_the_ini_option_runs_every_async_test_on_each_loop(pytester: pytest.Pytester) -> None:
    pytester.makeini(ASYNC_INI.format(extra="aiokvo_loop_factories = uvloop asyncio"))
    pytester.makepyfile(LOOP_REPORT)
    result = pytester.runpytest("-s", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random([
        "*aiokvo: async tests run on uvloop, asyncio*",
        "*test_loop[[]uvloop[]]*", "*test_loop[[]asyncio[]]*", "*LOOP uvloop*", "*LOOP asyncio*",
    ])


def test_both_loops_widens_one_test(pytester: pytest.Pytester) -> None:
    (pytester.path / "tox.ini").unlink()  # pyproject.toml instead
    pytester.makepyprojecttoml("""
        [tool.pytest.ini_options]
        filterwarnings = ["ignore::pytest.PytestAssertRewriteWarning"]
        asyncio_mode = "auto"
        asyncio_default_fixture_loop_scope = "function"
        aiokvo_loop_factories = ["uvloop"]
    """)
    pytester.makepyfile(LOOP_REPORT + """

import pytest

@pytest.mark.aiokvo_both_loops
async def test_both():
    pass
""")
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines_random(
        ["*test_loop PASSED*", "*test_both[[]uvloop[]]*", "*test_both[[]asyncio[]]*"])


def test_the_command_line_overrides_the_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini(ASYNC_INI.format(extra="aiokvo_loop_factories = uvloop"))
    pytester.makepyfile(LOOP_REPORT)
    result = pytester.runpytest("-s", "--aiokvo-loops=asyncio")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*LOOP asyncio*"])


def test_an_unknown_loop_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini(ASYNC_INI.format(extra="aiokvo_loop_factories = uvloop trio"))
    pytester.makepyfile(LOOP_REPORT)
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*aiokvo_loop_factories: unknown event loop 'trio'; "
                                 "known: uvloop, asyncio*"])


def test_fixtures_serve_a_users_store_and_load_on_the_fake_cuda_driver(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(ASYNC_INI.format(extra="aiokvo_loop_factories = uvloop"))
    pytester.makepyfile("""
        import os, stat
        import torch
        from aiokvo import CPULoadStoreSpec, GPULoadStoreSpec
        from aiokvo.handlers.cuda.pair import make_cuda_handlers
        from aiokvo.testing import assert_no_leaks, drain

        async def test_round_trip(kv_caches, fake_cuda_driver, aiokvo_leak_check):
            kv = kv_caches(layers=3, blocks=8, dtype=torch.float16)
            assert kv.tensors[0].shape == (2, 8, 16, 8, 128)
            pair = make_cuda_handlers(kv.canonical, block_size_factor=1, num_cpu_blocks=4,
                                      driver=fake_cuda_driver)
            async with pair:
                store = pair.gpu_to_cpu.transfer_async(
                    1, (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([3, 2])))
                (stored,) = await drain(store)
                assert stored.success
                load = pair.cpu_to_gpu.transfer_async(
                    2, (CPULoadStoreSpec([3, 2]), GPULoadStoreSpec([6, 7], [2], [0])))
                await drain(load, pair.cpu_to_gpu)
            assert kv.blocks_equal([0, 1], [6, 7]) and not kv.blocks_equal([0], [5])
            assert_no_leaks(driver=fake_cuda_driver)

        def test_disk_dir(disk_tier_path):
            info = os.lstat(disk_tier_path)
            assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
            assert list(disk_tier_path.iterdir()) == []

        def test_gpu_caches_skip_without_cuda(kv_caches):
            kv = kv_caches(device="cuda")
            assert kv.device.type == "cuda"
    """)
    result = pytester.runpytest("-rs")
    if torch.cuda.is_available():
        result.assert_outcomes(passed=3)
    else:
        result.assert_outcomes(passed=2, skipped=1)
        result.stdout.fnmatch_lines(["*kv_caches(device='cuda') needs a CUDA device*"])


def test_the_leak_check_fixture_fails_a_test_that_leaves_a_thread(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("""
        import threading

        stop = threading.Event()

        def test_leaky(aiokvo_leak_check):
            threading.Thread(target=stop.wait, name="aiokvo-leaky", daemon=True).start()

        def test_after():
            stop.set()
    """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*threads still running: aiokvo-leaky*"])


PROJECT_GPU_MARKER = """
import pytest

@pytest.mark.gpu("a100")            # the project's own marker, its own meaning
def test_own_marker():
    pass

@pytest.mark.both_loops
def test_own_both_loops():
    pass

@pytest.mark.min_gpu_memory
def test_own_memory_marker():
    pass
"""


def test_a_projects_own_gpu_markers_are_left_alone(pytester: pytest.Pytester) -> None:
    """Installing aiokvo used to skip a project's @pytest.mark.gpu tests, or stop its
    session with a UsageError when the marker's arguments were not aiokvo's."""
    pytester.makeconftest("""
        def pytest_configure(config):
            for name in ("gpu", "both_loops", "min_gpu_memory"):
                config.addinivalue_line("markers", f"{name}: the project's own")

        def pytest_aiokvo_gpus(config):
            raise AssertionError("aiokvo probed for a project's own marker")
    """)
    pytester.makepyfile(PROJECT_GPU_MARKER)
    result = pytester.runpytest("-v", "--strict-markers")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK


def test_the_short_marker_names_are_opt_in(pytester: pytest.Pytester) -> None:
    pytester.makeini(ASYNC_INI.format(extra="aiokvo_markers = short  # gpu, both_loops, ..."))
    pytester.makeconftest(TWO_GPUS_CONFTEST)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.gpu(2)
        def test_two(): pass

        @pytest.mark.gpu(3)
        def test_three(): pass

        @pytest.mark.aiokvo_gpu(3)
        def test_three_namespaced(): pass
    """)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*needs 3 CUDA devices, found 2*"])


def test_opting_in_to_short_names_the_project_registers_itself_is_refused(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(ASYNC_INI.format(extra="aiokvo_markers = short\nmarkers =\n    gpu: ours"))
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*aiokvo_markers = short, but the project registers gpu "
                                 "itself*"])


def test_ini_values_may_end_in_a_comment(pytester: pytest.Pytester) -> None:
    """docs/testing.md's ini line, copied with its comment, used to stop the session:
    ``aiokvo_loop_factories: unknown event loop '#'``."""
    pytester.makeini(ASYNC_INI.format(
        extra="aiokvo_loop_factories = uvloop asyncio   # opt in: every async test on both"))
    pytester.makepyfile(LOOP_REPORT)
    result = pytester.runpytest("-s", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random(["*LOOP uvloop*", "*LOOP asyncio*"])


def test_a_projects_own_fixture_of_the_same_name_wins(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
        import pytest

        @pytest.fixture
        def kv_caches():
            return "the project's"
    """)
    pytester.makepyfile("""
        def test_own(kv_caches):
            assert kv_caches == "the project's"
    """)
    pytester.runpytest().assert_outcomes(passed=1)


def test_the_plugin_can_be_turned_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        def test_no_fixture(request):
            assert "kv_caches" not in request.fixturenames
    """)
    result = pytester.runpytest("-p", "no:aiokvo", "--fixtures")
    result.stdout.no_fnmatch_line("*kv_caches*")
