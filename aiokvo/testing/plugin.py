"""aiokvo's pytest plugin (entry point ``pytest11: aiokvo``), for users' own suites.

Loaded automatically wherever aiokvo is installed; ``-p no:aiokvo`` turns it
off. What it adds (docs/testing.md has the walk-through):

* **Markers** ``gpu``, ``gpu(n)``, ``multi_gpu(n=2)``, ``min_gpu_memory(gib)``:
  skip with a reason unless enough CUDA devices (with enough total memory)
  are visible. Deciding never initialises CUDA in the test process
  (:mod:`aiokvo.testing.gpu`); ``pytest_aiokvo_gpus`` can supply the
  inventory instead.
* **Event loops**, opt-in per project: ``aiokvo_loop_factories = uvloop
  asyncio`` in the ini file (or ``--aiokvo-loops=uvloop,asyncio``) runs each
  async test on those loops through pytest-asyncio's
  ``pytest_asyncio_loop_factories`` hook; ``@pytest.mark.both_loops`` runs
  one test on both. Without the option the plugin leaves the loop alone.
* **Fixtures**: ``kv_caches`` (a factory of engine-shaped KV caches, CPU or
  GPU), ``fake_cuda_driver`` (the CUDA backend without a GPU),
  ``disk_tier_path`` (an owner-only directory for a disk tier),
  ``mooncake_cluster`` (a factory of throwaway Mooncake clusters on loopback,
  a master and storage-node processes stopped by pid after the test; skips
  naming what is missing, fails on CI), ``make_offloader`` and ``offloader``
  (open Offloaders, drained, checked for leaks and closed when the test
  ends; they need pytest-asyncio) and ``aiokvo_leak_check`` (fails the test
  if it left ``aiokvo-*`` threads running); the helpers
  ``aiokvo.testing.drain`` and ``assert_no_leaks``.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
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
    from aiokvo.testing.kv import KVCaches
    from aiokvo.testing.mooncake import ClusterFactory
    from aiokvo.testing.offloaders import OffloaderFactory

INI_LOOPS = "aiokvo_loop_factories"
GPU_MARKERS = ("gpu", "multi_gpu", "min_gpu_memory")
_INVENTORY = pytest.StashKey[GpuInventory]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        INI_LOOPS, type="args", default=[],
        help="event loops every async test runs on (uvloop, asyncio); empty: leave "
        "pytest-asyncio's default loop alone",
    )
    group = parser.getgroup("aiokvo")
    group.addoption(
        "--aiokvo-loops", metavar="NAMES", default=None,
        help=f"comma-separated event loops for async tests ({', '.join(LOOP_NAMES)}); "
        f"overrides the {INI_LOOPS} ini option",
    )


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "gpu(n=1): needs n CUDA devices; skipped with a reason otherwise",
        "multi_gpu(n=2): needs n CUDA devices; skipped with a reason otherwise",
        "min_gpu_memory(gib): needs a CUDA device with at least gib GiB of memory",
        "both_loops: run this async test on uvloop and on the stdlib loop "
        f"(with {INI_LOOPS} set)",
    ):
        config.addinivalue_line("markers", line)
    option = config.getoption("--aiokvo-loops")
    names = ([n.strip() for n in option.split(",") if n.strip()] if option is not None
             else list(config.getini(INI_LOOPS)))
    if not names:
        return
    if not config.pluginmanager.hasplugin("asyncio"):
        raise pytest.UsageError(f"{INI_LOOPS} needs pytest-asyncio (>= 1.4), which is not loaded")
    try:
        factories = LoopFactories(names)
    except ValueError as exc:
        raise pytest.UsageError(f"{INI_LOOPS}: {exc}") from None
    config.pluginmanager.register(factories, "aiokvo-loop-factories")


@pytest.hookimpl(trylast=True)
def pytest_aiokvo_gpus(config: pytest.Config) -> GpuInventory:
    return probe_gpus()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items
              if any(item.get_closest_marker(name) for name in GPU_MARKERS)]
    if not marked:
        return  # no probe at all for suites without GPU tests
    inventory = config.stash.get(_INVENTORY, None)
    if inventory is None:
        inventory = config.stash[_INVENTORY] = config.hook.pytest_aiokvo_gpus(config=config)
    for item in marked:
        args = [m.args if (m := item.get_closest_marker(name)) else None for name in GPU_MARKERS]
        try:
            needed = requirement(args[0], args[1], args[2], item.nodeid)
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
def kv_caches() -> Callable[..., KVCaches]:
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
