"""Test support for projects built on aiokvo (and for aiokvo's own suite).

The pytest plugin (:mod:`aiokvo.testing.plugin`, loaded automatically)
brings the GPU markers, the opt-in event-loop factories and the fixtures;
this package holds what a test imports directly:

* :func:`FaultyTier` and :class:`Faults`: a tier that flips bytes, fails
  with EIO, stalls past its deadline and loses blocks on purpose, seeded
  (:mod:`aiokvo.testing.faulty`);
* :func:`drain`, :func:`assert_no_leaks` and :func:`offloader_leaks`
  (:mod:`aiokvo.testing.leaks`);
* :class:`OffloaderFactory` and :func:`offload_config`
  (:mod:`aiokvo.testing.offloaders`, the ``make_offloader`` fixture's);
* :func:`make_kv_caches`, :class:`KVCaches` and :class:`KVCachesFactory`
  (:mod:`aiokvo.testing.kv`, needs torch);
* :func:`probe_gpus`, :class:`GpuInfo`, :class:`GpuInventory`
  (:mod:`aiokvo.testing.gpu`);
* :func:`missing_mooncake`, :func:`require_mooncake` and :class:`ClusterFactory`
  (:mod:`aiokvo.testing.mooncake`); :class:`LocalCluster`, a real
  throwaway Mooncake cluster on loopback
  (:mod:`aiokvo.testing.mooncake_cluster`), and :class:`FakeMooncakeCluster`,
  an in-process stand-in (:mod:`aiokvo.testing.mooncake_fake`).

The fixtures' types, for annotating tests: ``kv_caches`` is a
:class:`KVCachesFactory`, ``make_offloader`` an :class:`OffloaderFactory`,
``mooncake_cluster`` a :class:`ClusterFactory`.

Names resolve lazily, so the plugin's import at pytest start-up loads
neither torch nor CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiokvo._util import lazy_export

if TYPE_CHECKING:
    from aiokvo.testing.faulty import Faults, FaultyStore, FaultyTier
    from aiokvo.testing.gpu import GpuInfo, GpuInventory, probe_gpus
    from aiokvo.testing.kv import KVCaches, KVCachesFactory, make_kv_caches
    from aiokvo.testing.leaks import assert_no_leaks, drain, leaked_threads, offloader_leaks
    from aiokvo.testing.mooncake import ClusterFactory, missing_mooncake, require_mooncake
    from aiokvo.testing.mooncake_cluster import LocalCluster
    from aiokvo.testing.mooncake_fake import FakeMooncakeCluster, FakeMooncakeStore
    from aiokvo.testing.offloaders import OffloaderFactory, offload_config

__all__ = [
    "ClusterFactory",
    "FakeMooncakeCluster",
    "FakeMooncakeStore",
    "FaultyStore",
    "FaultyTier",
    "Faults",
    "GpuInfo",
    "GpuInventory",
    "KVCaches",
    "KVCachesFactory",
    "LocalCluster",
    "OffloaderFactory",
    "assert_no_leaks",
    "drain",
    "leaked_threads",
    "make_kv_caches",
    "missing_mooncake",
    "offload_config",
    "offloader_leaks",
    "probe_gpus",
    "require_mooncake",
]

_WHERE = {
    "GpuInfo": "gpu", "GpuInventory": "gpu", "probe_gpus": "gpu",
    "KVCaches": "kv", "KVCachesFactory": "kv", "make_kv_caches": "kv",
    "assert_no_leaks": "leaks", "drain": "leaks", "leaked_threads": "leaks",
    "offloader_leaks": "leaks",
    "OffloaderFactory": "offloaders", "offload_config": "offloaders",
    "missing_mooncake": "mooncake", "require_mooncake": "mooncake",
    "LocalCluster": "mooncake_cluster",
    "FaultyStore": "faulty", "FaultyTier": "faulty", "Faults": "faulty",
    "FakeMooncakeCluster": "mooncake_fake", "FakeMooncakeStore": "mooncake_fake",
    "ClusterFactory": "mooncake",
}

_MODULES = {name: f"{__name__}.{module}" for name, module in _WHERE.items()}


def __getattr__(name: str) -> Any:
    return lazy_export(globals(), _MODULES, name)
