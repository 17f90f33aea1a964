"""``DiskTierConfig``: a disk tier's settings, validated once (pure data).

:class:`~aiokvo.tiers.disk.DiskTier` takes the same keywords and builds one
of these; :class:`~aiokvo.OffloadConfig` keeps them in ``tiers`` (from
``from_dict``'s ``"tiers": [{"kind": "disk", ...}]``), so an engine's JSON
config can ask for a disk tier. docs/tiers.md describes every knob.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Literal

from aiokvo._settings import check_seconds
from aiokvo._util import check_choice, check_int
from aiokvo.errors import ConfigError
from aiokvo.tiers.disk.runs import DEFAULT_MAX_IO_BYTES, DEFAULT_READ_THREADS
from aiokvo.tiers.settings import MAX_BYTES, TierSettings

__all__ = ["FSYNC_POLICIES", "DiskTierConfig", "FsyncPolicy"]


FsyncPolicy = Literal["none", "commit"]
FSYNC_POLICIES: tuple[FsyncPolicy, ...] = ("none", "commit")


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierConfig(TierSettings):
    """A disk tier's settings: :class:`~aiokvo.tiers.settings.TierSettings` and its own
    (docs/tiers.md, "Knobs")."""

    root: str
    """The directory the tier's layout directories go in (created 0700 if missing)."""
    capacity_bytes: int
    """Bytes this process's slab (its index and data file) may take there."""
    fsync: FsyncPolicy = "none"
    """``"commit"``: a committed block survives a power loss (two ``fdatasync`` a write)."""
    policy: str = "lru"
    """The slots' eviction policy (``"lru"``, ``"arc"``, a module path)."""
    direct_io: bool | None = None
    """Use O_DIRECT (None: probe the filesystem; True or False: force it)."""
    refresh_interval: float = 2.0
    """Seconds between looks at other processes' slabs (0: only at open and on demand)."""
    max_io_bytes: int = DEFAULT_MAX_IO_BYTES
    """Bytes one system call moves when adjacent slots go together (slot size or less:
    one call per block)."""
    read_threads: int = DEFAULT_READ_THREADS
    """Reads of one big promotion in flight at once."""

    kind: ClassVar[str] = "disk"
    _ints: ClassVar[tuple[str, ...]] = ("capacity_bytes", "max_io_bytes", "read_threads")
    _seconds: ClassVar[tuple[str, ...]] = ("refresh_interval",)

    def __post_init__(self) -> None:
        TierSettings.__post_init__(self)
        root = self.root
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str) or not root:
            raise ConfigError(f"root must be a directory path, got {self.root!r}")
        self._set("root", root)
        self._set("capacity_bytes",
                  check_int("capacity_bytes", self.capacity_bytes, minimum=1, maximum=MAX_BYTES))
        check_choice("fsync", self.fsync, FSYNC_POLICIES)
        if not isinstance(self.policy, str) or not self.policy:
            raise ConfigError(f"policy must be a cache policy name, got {self.policy!r}")
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise ConfigError(
                f"direct_io must be None (probe), True or False, got {self.direct_io!r}"
            )
        self._set("refresh_interval",
                  check_seconds("refresh_interval", self.refresh_interval, allow_zero=True))
        self._set("max_io_bytes",
                  check_int("max_io_bytes", self.max_io_bytes, minimum=1, maximum=1 << 30))
        self._set("read_threads", check_int("read_threads", self.read_threads, minimum=1,
                                            maximum=64))  # fmt: skip
