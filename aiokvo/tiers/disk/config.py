"""``DiskTierConfig``: a disk tier's settings, validated once (pure data).

:class:`~aiokvo.tiers.disk.DiskTier` takes the same keywords and builds one
of these; :class:`~aiokvo.OffloadConfig` keeps them in ``tiers`` (from
``from_dict``'s ``"tiers": [{"kind": "disk", ...}]``), so an engine's JSON
config can ask for a disk tier. docs/tiers.md describes every knob.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from aiokvo._settings import check_seconds, settings_from_dict
from aiokvo._util import check_choice, check_int, check_text
from aiokvo.errors import ConfigError
from aiokvo.tiers.disk.runs import DEFAULT_MAX_IO_BYTES, DEFAULT_READ_THREADS

if TYPE_CHECKING:
    from aiokvo.tiers.base import Tier

__all__ = ["FSYNC_POLICIES", "DiskTierConfig", "FsyncPolicy"]

FsyncPolicy = Literal["none", "commit"]
FSYNC_POLICIES: tuple[FsyncPolicy, ...] = ("none", "commit")
_INT_FIELDS = (
    "capacity_bytes",
    "admit_after",
    "failure_threshold",
    "max_tracked",
    "max_write_blocks",
    "max_io_bytes",
    "read_threads",
)
_SECONDS_FIELDS = ("io_timeout", "refresh_interval", "reset_after")


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierConfig:
    """Settings of one disk tier (see docs/tiers.md, "Knobs").

    ``root`` is the directory the tier's layout directories go in (created
    0700 if missing); ``capacity_bytes`` bounds the files this process's slab
    takes there. ``model_id`` (and ``dtype``, else the engine tensors') name
    the bytes in the layout fingerprint.
    """

    root: str
    capacity_bytes: int
    model_id: str
    dtype: str | None = None
    admit_after: int = 1
    fsync: FsyncPolicy = "none"
    policy: str = "lru"
    io_timeout: float = 10.0
    direct_io: bool | None = None
    refresh_interval: float = 2.0
    failure_threshold: int = 3
    reset_after: float = 5.0
    max_tracked: int = 64_000
    max_write_blocks: int | None = None
    max_io_bytes: int = DEFAULT_MAX_IO_BYTES
    read_threads: int = DEFAULT_READ_THREADS

    kind = "disk"

    def __post_init__(self) -> None:
        root = self.root
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str) or not root:
            raise ConfigError(f"root must be a directory path, got {self.root!r}")
        object.__setattr__(self, "root", root)
        object.__setattr__(
            self, "capacity_bytes", check_int("capacity_bytes", self.capacity_bytes, minimum=1)
        )
        check_text("model_id", self.model_id)
        if self.dtype is not None:
            check_text("dtype", self.dtype)
        admit_after = check_int("admit_after", self.admit_after, minimum=1)
        object.__setattr__(self, "admit_after", admit_after)
        check_choice("fsync", self.fsync, FSYNC_POLICIES)
        if not isinstance(self.policy, str) or not self.policy:
            raise ConfigError(f"policy must be a cache policy name, got {self.policy!r}")
        object.__setattr__(self, "io_timeout", check_seconds("io_timeout", self.io_timeout))
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise ConfigError(
                f"direct_io must be None (probe), True or False, got {self.direct_io!r}"
            )
        object.__setattr__(
            self, "refresh_interval",
            check_seconds("refresh_interval", self.refresh_interval, allow_zero=True),
        )  # fmt: skip
        object.__setattr__(
            self, "failure_threshold",
            check_int("failure_threshold", self.failure_threshold, minimum=1),
        )  # fmt: skip
        object.__setattr__(self, "reset_after", check_seconds("reset_after", self.reset_after))
        max_tracked = check_int("max_tracked", self.max_tracked, minimum=1)
        object.__setattr__(self, "max_tracked", max_tracked)
        if self.max_write_blocks is not None:
            object.__setattr__(
                self, "max_write_blocks",
                check_int("max_write_blocks", self.max_write_blocks, minimum=1),
            )  # fmt: skip
        max_io_bytes = check_int("max_io_bytes", self.max_io_bytes, minimum=1)
        object.__setattr__(self, "max_io_bytes", max_io_bytes)
        read_threads = check_int("read_threads", self.read_threads, minimum=1)
        object.__setattr__(self, "read_threads", read_threads)

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> DiskTierConfig:
        """From a JSON-style mapping (``kind`` may be present); unknown keys are errors.

        Integers and seconds may be numeric strings, as in vLLM's extra config.
        """
        return settings_from_dict(
            cls, settings, "disk tier", ints=_INT_FIELDS, seconds=_SECONDS_FIELDS
        )

    def build(self) -> Tier:
        """A :class:`~aiokvo.tiers.disk.DiskTier` with these settings."""
        import importlib  # by name: the tier (I/O) is above its settings (pure)

        tier: Tier = importlib.import_module("aiokvo.tiers.disk.tier").DiskTier.from_config(self)
        return tier
