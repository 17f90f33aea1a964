"""Mooncake in tests: what is missing, and the throwaway-cluster fixture's engine.

A real cluster needs the ``mooncake`` package (``pip install
'aiokvo[mooncake]'``) and three Debian libraries even over TCP:
``libibverbs1``, ``libnuma1`` and ``libcurl4`` (``librdmacm1`` too for RDMA).
:func:`missing_mooncake` says exactly which are absent;
:func:`require_mooncake` skips the calling test with that list, or fails it
where a missing dependency is a broken setup rather than a choice: on CI
(``CI=true``) or with ``AIOKVO_REQUIRE_MOONCAKE=1``.

:class:`ClusterFactory` is what the plugin's ``mooncake_cluster`` fixture
yields: ``mooncake_cluster(nodes=2, segment_size=...)`` starts a
:class:`~aiokvo.testing.mooncake_cluster.LocalCluster` (keywords as there) and
every cluster it started is stopped, by pid, when the test ends.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiokvo.testing.mooncake_cluster import LocalCluster

__all__ = [
    "REQUIRE_ENV",
    "SYSTEM_LIBRARIES",
    "ClusterFactory",
    "missing_mooncake",
    "mooncake_required",
    "require_mooncake",
]

REQUIRE_ENV = "AIOKVO_REQUIRE_MOONCAKE"

SYSTEM_LIBRARIES: dict[str, str] = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}
"""Shared libraries Mooncake's extension and ``mooncake_master`` load -> Debian package."""


def missing_mooncake() -> list[str]:
    """What a real Mooncake cluster needs here and does not find (empty: all there)."""
    missing: list[str] = []
    packages = []
    for library, package in SYSTEM_LIBRARIES.items():
        try:
            ctypes.CDLL(library)
        except OSError:
            packages.append(package)
    if packages:
        missing.append(
            f"system libraries {', '.join(packages)} "
            f"(Debian, as root: apt-get install -y {' '.join(packages)}; `make test` does it)"
        )
    if importlib.util.find_spec("mooncake") is None:
        missing.append(
            "the Python package mooncake-transfer-engine-non-cuda "
            "(pip install 'aiokvo[mooncake]'; the dev install has it)"
        )
    elif not packages:
        try:
            importlib.import_module("mooncake.store")
        except ImportError as exc:
            missing.append(f"a working mooncake.store (importing it failed: {exc})")
    return missing


def mooncake_required() -> bool:
    """Whether a missing Mooncake fails tests instead of skipping them (CI, or asked)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or bool(
        os.environ.get(REQUIRE_ENV)
    )


def require_mooncake() -> None:
    """Skip the calling test naming what is missing, or fail it on CI; nothing if all is there."""
    import pytest

    missing = missing_mooncake()
    if not missing:
        return
    message = "a Mooncake cluster needs " + "; ".join(missing)
    if mooncake_required():
        pytest.fail(f"{message} (required: CI=true or {REQUIRE_ENV} is set)", pytrace=False)
    pytest.skip(message)


class ClusterFactory:
    """Starts :class:`~aiokvo.testing.LocalCluster`\\ s for one test; stops them all.

    ``setenv`` applies a cluster's :attr:`client_env
    <aiokvo.testing.mooncake_cluster.LocalCluster.client_env>` to this process
    for the test (pytest's ``monkeypatch.setenv``).
    """

    def __init__(self, workdir: Path, setenv: Callable[[str, str], None]) -> None:
        self._workdir = workdir
        self._setenv = setenv
        self.clusters: list[LocalCluster] = []

    def __call__(self, nodes: int = 1, **options: Any) -> LocalCluster:
        require_mooncake()
        from aiokvo.testing.mooncake_cluster import LocalCluster

        workdir = self._workdir / f"cluster{len(self.clusters)}"
        workdir.mkdir(mode=0o700)
        cluster = LocalCluster(nodes, workdir=workdir, **options)
        self.clusters.append(cluster)
        cluster.start()
        for name, value in cluster.client_env.items():
            self._setenv(name, value)
        return cluster

    def stop(self) -> None:
        for cluster in reversed(self.clusters):
            cluster.stop()
