"""aiokvo's pytest plugin (entry point ``pytest11: aiokvo``), for users' own suites.

Loaded automatically wherever aiokvo is installed, so it claims nothing a
project may define itself: its markers, ini options, command-line options
and hooks are named ``aiokvo_*``, and it changes nothing about a test that
does not use them. ``-p no:aiokvo`` turns it off. What it adds
(docs/testing.md has the walk-through):

* **Markers** ``aiokvo_gpu``, ``aiokvo_gpu(n)``, ``aiokvo_multi_gpu(n=2)``,
  ``aiokvo_min_gpu_memory(gib)``: skip with a reason unless enough CUDA
  devices (with enough total memory) are visible. Deciding never initialises
  CUDA in the test process (:mod:`aiokvo.testing.gpu`); ``pytest_aiokvo_gpus``
  can supply the inventory instead. A project that has no markers of those
  names itself may opt in to the short names (``gpu``, ``multi_gpu``,
  ``min_gpu_memory``, ``both_loops``) with ``aiokvo_markers = short`` in its
  ini file (aiokvo's own suite does).
* **Event loops**, opt-in per project: ``aiokvo_loop_factories = uvloop
  asyncio`` in the ini file (or ``--aiokvo-loops=uvloop,asyncio``) runs each
  async test on those loops through pytest-asyncio's
  ``pytest_asyncio_loop_factories`` hook; ``@pytest.mark.aiokvo_both_loops``
  runs one test on both. Without the option the plugin leaves the loop alone.
* **Fixtures**: ``kv_caches`` (a factory of engine-shaped KV caches, CPU or
  GPU), ``fake_cuda_driver`` (the CUDA backend without a GPU),
  ``disk_tier_path`` (an owner-only directory for a disk tier),
  ``mooncake_cluster`` (a factory of throwaway Mooncake clusters on loopback,
  a master and storage-node processes stopped by pid after the test; skips
  naming what is missing, fails on CI), ``make_offloader`` and ``offloader``
  (open Offloaders, drained, checked for leaks and closed when the test
  ends; they need pytest-asyncio) and ``aiokvo_leak_check`` (fails the test
  if it left ``aiokvo-*`` threads running); the helpers
  ``aiokvo.testing.drain`` and ``assert_no_leaks``. A project's own fixture
  of the same name wins (pytest prefers a conftest's fixtures to a plugin's).

The ini options' values may end in a ``# comment`` (an ini line is copied
from the docs with its comment more often than not).
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from aiokvo.testing import hookspecs
from aiokvo.testing.gpu import GpuInventory, probe_gpus, requirement
from aiokvo.testing.loops import LOOP_NAMES, LoopFactories

try:
    import pytest_asyncio

    HAVE_PYTEST_ASYNCIO = True
except ImportError:  # the offloader fixtures then say what they need
    HAVE_PYTEST_ASYNCIO = False

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from aiokvo.device.fake import FakeDriver
    from aiokvo.offloader import Offloader
    from aiokvo.testing.kv import KVCaches, KVCachesFactory
    from aiokvo.testing.mooncake import ClusterFactory
    from aiokvo.testing.offloaders import OffloaderFactory

INI_LOOPS = "aiokvo_loop_factories"
INI_MARKERS = "aiokvo_markers"
MARKER_STYLES = ("namespaced", "short")
GPU_MARKERS = ("aiokvo_gpu", "aiokvo_multi_gpu", "aiokvo_min_gpu_memory")
SHORT_GPU_MARKERS = ("gpu", "multi_gpu", "min_gpu_memory")
BOTH_LOOPS = "aiokvo_both_loops"
_INVENTORY = pytest.StashKey[GpuInventory]()
_SHORT = pytest.StashKey[bool]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        INI_LOOPS, type="args", default=[],
        help="event loops every async test runs on (uvloop, asyncio); empty: leave "
        "pytest-asyncio's default loop alone",
    )
    parser.addini(
        INI_MARKERS, type="args", default=["namespaced"],
        help="'namespaced' (default): aiokvo's markers are aiokvo_gpu, aiokvo_multi_gpu, "
        "aiokvo_min_gpu_memory, aiokvo_both_loops; 'short': also gpu, multi_gpu, "
        "min_gpu_memory, both_loops (for projects that define no such markers)",
    )
    group = parser.getgroup("aiokvo")
    group.addoption(
        "--aiokvo-loops", metavar="NAMES", default=None,
        help=f"comma-separated event loops for async tests ({', '.join(LOOP_NAMES)}); "
        f"overrides the {INI_LOOPS} ini option",
    )


def ini_words(config: pytest.Config, name: str) -> list[str]:
    """An ``args`` ini option's words, up to a ``#`` comment (pytest would keep it)."""
    words: list[str] = []
    for word in config.getini(name):
        if word.startswith("#"):
            break
        words.append(word)
    return words


def pytest_configure(config: pytest.Config) -> None:
    style = ini_words(config, INI_MARKERS)
    if len(style) != 1 or style[0] not in MARKER_STYLES:
        raise pytest.UsageError(
            f"{INI_MARKERS} must be one of {', '.join(MARKER_STYLES)}, got {' '.join(style)!r}"
        )
    short = config.stash[_SHORT] = style[0] == "short"
    if short:
        # The project's own ini markers, registered before ours: a clash is its choice to fix.
        own = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
        clash = sorted(own & {*SHORT_GPU_MARKERS, "both_loops"})
        if clash:
            raise pytest.UsageError(
                f"{INI_MARKERS} = short, but the project registers {', '.join(clash)} itself; "
                f"use aiokvo's aiokvo_* markers (remove {INI_MARKERS})"
            )
    prefixes = ("aiokvo_", "") if short else ("aiokvo_",)
    for prefix in prefixes:
        for line in (
            "gpu(n=1): needs n CUDA devices; skipped with a reason otherwise",
            "multi_gpu(n=2): needs n CUDA devices; skipped with a reason otherwise",
            "min_gpu_memory(gib): needs a CUDA device with at least gib GiB of memory",
            "both_loops: run this async test on uvloop and on the stdlib loop "
            f"(with {INI_LOOPS} set)",
        ):
            config.addinivalue_line("markers", f"{prefix}{line} (aiokvo)")
    option = config.getoption("--aiokvo-loops")
    names = ([n.strip() for n in option.split(",") if n.strip()] if option is not None
             else ini_words(config, INI_LOOPS))
    if not names:
        return
    if not config.pluginmanager.hasplugin("asyncio"):
        raise pytest.UsageError(f"{INI_LOOPS} needs pytest-asyncio (>= 1.4), which is not loaded")
    both = (BOTH_LOOPS, "both_loops") if short else (BOTH_LOOPS,)
    try:
        factories = LoopFactories(names, both_loops_markers=both)
    except ValueError as exc:
        raise pytest.UsageError(f"{INI_LOOPS}: {exc}") from None
    config.pluginmanager.register(factories, "aiokvo-loop-factories")


@pytest.hookimpl(trylast=True)
def pytest_aiokvo_gpus(config: pytest.Config) -> GpuInventory:
    return probe_gpus()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = [GPU_MARKERS]
    if config.stash.get(_SHORT, False):
        groups.append(SHORT_GPU_MARKERS)
    marked = [(item, names) for item in items for names in groups
              if any(item.get_closest_marker(name) for name in names)]
    if not marked:
        return  # no probe at all for suites without GPU tests
    inventory = config.stash.get(_INVENTORY, None)
    if inventory is None:
        inventory = config.stash[_INVENTORY] = config.hook.pytest_aiokvo_gpus(config=config)
    for item, names in marked:
        args = [m.args if (m := item.get_closest_marker(name)) else None for name in names]
        try:
            needed = requirement(args[0], args[1], args[2], item.nodeid, names)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        reason = needed.unmet(inventory)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config: pytest.Config) -> str | None:
    names = config.pluginmanager.get_plugin("aiokvo-loop-factories")
    if isinstance(names, LoopFactories):
        return f"aiokvo: async tests run on {', '.join(names.names)}"
    return None


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture
def kv_caches() -> KVCachesFactory:
    """A factory of engine-shaped KV caches: ``kv_caches(layers=2, blocks=64, dtype=...)``.

    Keyword arguments as :func:`aiokvo.testing.kv.make_kv_caches` (also
    ``block_size``, ``kv_heads``, ``head_dim``, ``device``, ``layout``,
    ``seed``). ``device="cuda"`` skips the test when no CUDA device is usable.
    """
    from aiokvo.testing.kv import make_kv_caches

    def make(**kwargs: Any) -> KVCaches:
        device = str(kwargs.get("device", "cpu"))
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                pytest.skip(f"kv_caches(device={device!r}) needs a CUDA device")
        return make_kv_caches(**kwargs)

    return make


@pytest.fixture
def fake_cuda_driver() -> Iterator[FakeDriver]:
    """:class:`aiokvo.device.fake.FakeDriver`: pass it as ``driver=`` to CUDA-backend objects.

    Host memory stands in for device memory and each stream is a thread, so
    the CUDA backend's code paths (streams, events, pinned memory, kernels)
    run without a GPU. Its stream threads are stopped after the test.
    """
    from aiokvo.device.fake import FakeDriver

    driver = FakeDriver()
    yield driver
    driver.close()


@pytest.fixture
def disk_tier_path(tmp_path: Path) -> Path:
    """An empty directory for a disk tier: this user's, mode 0700, not a symlink.

    Made by :func:`aiokvo.memory.ownership.private_directory`, the rules the
    disk tier's own files follow.
    """
    from aiokvo.memory.ownership import private_directory

    path = private_directory(tmp_path, "aiokvo-disk")
    info = os.lstat(path)
    if stat.S_IMODE(info.st_mode) != 0o700:  # private_directory refuses group/other bits
        raise AssertionError(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}, not 0700")
    return path


@pytest.fixture
def mooncake_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ClusterFactory]:
    """A factory of throwaway Mooncake clusters: ``mooncake_cluster(nodes=2, ...)``.

    Each call starts a :class:`~aiokvo.tiers.mooncake.LocalCluster` (keywords
    as there: ``segment_size``, ``lease_ttl``, ``client_ttl``, ``metadata``,
    ...) on free loopback ports, its logs under ``tmp_path``; every one is
    stopped by pid when the test ends. Without Mooncake (the package, or the
    system libraries it loads) the test is skipped naming what is missing,
    and fails instead on CI (``CI=true``) or with ``AIOKVO_REQUIRE_MOONCAKE=1``.
    """
    from aiokvo.testing.mooncake import ClusterFactory

    factory = ClusterFactory(tmp_path, monkeypatch.setenv)
    try:
        yield factory
    finally:
        factory.stop()


if HAVE_PYTEST_ASYNCIO:

    @pytest_asyncio.fixture
    async def make_offloader() -> AsyncIterator[OffloaderFactory]:
        """A factory of open Offloaders: ``off = await make_offloader(kv, cpu_blocks=32, ...)``.

        Arguments as :class:`aiokvo.testing.offloaders.OffloaderFactory`
        (``kv`` from ``kv_caches``, ``cpu_blocks``, ``config``, ``tiers``,
        ``handler_options``, any ``OffloadConfig`` field). When the test ends
        each one's copies are waited for, it is checked for leaks (a lease
        never released, a store never completed, a lost block) and closed;
        leaks fail the test.
        """
        from aiokvo.testing.offloaders import OffloaderFactory

        factory = OffloaderFactory()
        try:
            yield factory
        finally:
            await factory.aclose()

    @pytest_asyncio.fixture
    async def offloader(make_offloader: OffloaderFactory) -> Offloader:
        """An open Offloader over ``make_kv_caches()``'s defaults with a 32-block CPU pool.

        Checked for leaks and closed when the test ends (``make_offloader``).
        Its KV caches are ``offloader.kv_caches`` (canonical); use
        ``make_offloader(kv_caches(...))`` to keep the engine tensors.
        """
        return await make_offloader()

else:

    @pytest.fixture
    def make_offloader() -> None:
        """Needs pytest-asyncio (``pip install 'aiokvo[testing]'``)."""
        pytest.fail("the make_offloader fixture needs pytest-asyncio (>= 1.4): "
                    "pip install 'aiokvo[testing]'", pytrace=False)

    @pytest.fixture
    def offloader() -> None:
        """Needs pytest-asyncio (``pip install 'aiokvo[testing]'``)."""
        pytest.fail("the offloader fixture needs pytest-asyncio (>= 1.4): "
                    "pip install 'aiokvo[testing]'", pytrace=False)


@pytest.fixture
def aiokvo_leak_check() -> Iterator[None]:
    """Fail the test if ``aiokvo-*`` threads it started are still running afterwards."""
    from aiokvo.testing.leaks import assert_no_leaks

    before = [t for t in threading.enumerate() if t.name.startswith("aiokvo-")]
    yield
    assert_no_leaks(ignore_threads=before)
