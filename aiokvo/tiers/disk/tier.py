"""``DiskTier``: a local disk tier below the CPU pool that never serves a wrong byte.

Hand it to the Offloader (``Offloader(config, kv, tiers=[DiskTier(root,
capacity_bytes=..., model_id=...)])``): a :class:`~aiokvo.tiers.engine.
StoreTier` over a :class:`~aiokvo.tiers.disk.store.DiskStore`. docs/tiers.md
has the format, the crash and restart rules and the knobs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from aiokvo.tiers.disk.config import DiskTierConfig
from aiokvo.tiers.disk.files import FileIO
from aiokvo.tiers.disk.store import DiskStore, DiskTierStatistics
from aiokvo.tiers.engine import StoreTier

__all__ = ["DiskTier", "DiskTierStatistics", "disk_tier"]


def DiskTier(
    root: str | os.PathLike[str],
    *,
    file_io: FileIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    **settings: Any,
) -> StoreTier:
    """A disk tier in ``root``: blocks of the CPU pool, checksummed, bounded, restart-safe.

    ``settings`` are :class:`~aiokvo.tiers.disk.DiskTierConfig`'s
    (``capacity_bytes`` and ``model_id`` required; docs/tiers.md, "Knobs");
    an unknown one is a ConfigError naming it. ``file_io`` replaces the
    system calls (tests), ``clock`` the breaker's clock.
    """
    return disk_tier(DiskTierConfig.of(root=root, **settings), file_io=file_io, clock=clock)


def disk_tier(
    config: DiskTierConfig,
    *,
    file_io: FileIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StoreTier:
    """A disk tier with ``config``'s settings."""
    return StoreTier(DiskStore(config, file_io=file_io), config, clock=clock)
