"""Engine-agnostic offloading configuration, validated once at construction.

The engine (vLLM or anything else) knows its KV groups' block sizes, its hash
block size and how many KV bytes one GPU block holds; the user knows how much
CPU memory to spend. :class:`OffloadConfig` joins the two and derives what
the spec needs (``block_size_factor``, ``num_cpu_blocks``), so that a bad value
fails here, with its field named, instead of deep inside a copy.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiokvo._settings import parse_int
from aiokvo._util import check_choice, check_int, check_name, check_text
from aiokvo.errors import ConfigError
from aiokvo.manager.policies.base import RECENCY_MODES, Recency
from aiokvo.manager.reuse import COUNTING_MODES, Counting

if TYPE_CHECKING:
    from aiokvo.tiers.registry import TierConfig

__all__ = ["EXTRA_CONFIG_KEYS", "OffloadConfig", "UnknownConfigKeyWarning"]

EXTRA_CONFIG_KEYS: frozenset[str] = frozenset(
    {
        "cpu_bytes_to_use",
        "block_size",
        "eviction_policy",
        "store_threshold",
        "max_tracker_size",
        "recency",
        "store_counting",
        "retention_fraction",
        "spec_name",
        "spec_module_path",
        "tiers",
    }
)
"""The ``kv_connector_extra_config`` keys :meth:`OffloadConfig.from_dict` reads."""


MAX_TOKENS_PER_BLOCK = 1 << 24
"""Tokens per GPU, hash or offloaded block: far past any engine's, so that a typo (a
byte count where tokens were meant) is refused here rather than deep inside a plan."""
MAX_KV_BYTES_PER_BLOCK = 1 << 40
MAX_WORLD_SIZE = 1 << 16
MAX_COUNT = (1 << 31) - 1
"""The largest ``store_threshold``, ``max_tracker_size`` and number of pool blocks:
block ids travel as int32 in vLLM's specs."""


@functools.cache
def machine_memory() -> int:
    """This machine's physical memory in bytes (the CPU pool is allocated, and pinned, in it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class UnknownConfigKeyWarning(UserWarning):
    """``from_dict`` met a key it does not read (usually a typo); it was ignored."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadConfig:
    """Everything needed to build an offloading spec, checked up front.

    The engine supplies the KV facts (block sizes, bytes per block, ranks), the
    user the budget and the policy; docs/config.md gives each field's rule.
    """

    gpu_block_sizes: tuple[int, ...]
    """Tokens per GPU block of each KV-cache group."""
    hash_block_size: int
    """Tokens per prefix-cache hash block (each GPU block size a multiple of it)."""
    cpu_bytes_to_use: int
    """CPU memory budget for the pool, in bytes."""
    kv_bytes_per_block: int
    """KV bytes of one GPU block on one rank (all layers and groups), so one offloaded
    block costs ``kv_bytes_per_block * world_size * block_size_factor`` bytes of CPU memory."""
    offloaded_block_size: int | None = None
    """Tokens per offloaded block, a multiple of the one GPU block size every group
    shares (None: the GPU block's)."""
    eviction_policy: str = "lru"
    """The pool's eviction policy (``"lru"``, ``"arc"`` or a policy module path)."""
    store_threshold: int = 0
    """0 or 1 stores everything; 2 or more stores a block only once it was looked up
    that many times (``FilterReusedOffloadingManager``)."""
    max_tracker_size: int = 64_000
    """Keys the reuse filter's counter holds at most."""
    recency: Recency = "touch"
    """``"touch"`` (the seed's rule, the default) or ``"request"`` (vLLM 0.32's); see
    docs/manager.md."""
    store_counting: Counting = "lookups"
    """What the reuse filter counts: ``"lookups"`` (the seed's, the default) or
    ``"offers"`` (vLLM 0.32's); see docs/manager.md."""
    enable_events: bool = False
    """Record the manager's events for ``take_events()``."""
    retention_fraction: float = 0.25
    """The share of the CPU pool ``Offloader.retain`` may hold at once (soft: retained
    blocks are evicted last, never refusing a store); 0 turns retention off."""
    world_size: int = 1
    """Ranks whose KV goes into one CPU pool."""
    rank: int = 0
    """This process's rank among ``world_size``."""
    instance_id: str | None = None
    """The engine's id, the same on every rank: the CPU pool becomes one shared region
    that all ``world_size`` ranks map, each as ``rank`` (None: every rank has a
    private pool)."""
    spec_name: str = "CPUOffloadingSpec"
    """The spec the factory builds."""
    spec_module_path: str | None = None
    """Where to find ``spec_name`` when it is not registered."""
    tiers: tuple[TierConfig, ...] = ()
    """The settings of the tiers below the CPU pool, top first (e.g. a
    :class:`~aiokvo.tiers.DiskTierConfig`); the Offloader builds them when it is
    not handed tier objects."""

    def __post_init__(self) -> None:
        sizes: object = self.gpu_block_sizes  # callers may pass a list
        if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence) or not sizes:
            raise ConfigError(
                f"gpu_block_sizes must be a non-empty sequence of ints, got {sizes!r}"
            )
        try:
            checked = tuple(
                check_int("gpu_block_sizes", size, minimum=1, maximum=MAX_TOKENS_PER_BLOCK)
                for size in sizes
            )
        except ConfigError as exc:
            raise ConfigError(f"{exc} in {sizes!r}") from None
        object.__setattr__(self, "gpu_block_sizes", checked)

        self._int_field("hash_block_size", minimum=1, maximum=MAX_TOKENS_PER_BLOCK)
        for size in self.gpu_block_sizes:
            if size % self.hash_block_size:
                raise ConfigError(
                    f"gpu_block_sizes entry {size} is not divisible by "
                    f"hash_block_size={self.hash_block_size}"
                )
        self._int_field("cpu_bytes_to_use", minimum=1)
        if self.cpu_bytes_to_use > machine_memory():
            raise ConfigError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} is more than this machine's memory "
                f"({machine_memory()} bytes)"
            )
        self._int_field("kv_bytes_per_block", minimum=0, maximum=MAX_KV_BYTES_PER_BLOCK)
        if self.offloaded_block_size is not None:
            self._check_offloaded_block_size(self.offloaded_block_size)
        check_text("eviction_policy", self.eviction_policy)
        self._int_field("store_threshold", minimum=0, maximum=MAX_COUNT)
        self._int_field("max_tracker_size", minimum=1, maximum=MAX_COUNT)
        check_choice("recency", self.recency, RECENCY_MODES)
        check_choice("store_counting", self.store_counting, COUNTING_MODES)
        if not isinstance(self.enable_events, bool):
            raise ConfigError(f"enable_events must be a bool, got {self.enable_events!r}")
        fraction: object = self.retention_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
            0.0 <= fraction <= 1.0
        ):  # fmt: skip
            raise ConfigError(f"retention_fraction must be a number in [0, 1], got {fraction!r}")
        object.__setattr__(self, "retention_fraction", float(fraction))
        self._int_field("world_size", minimum=1, maximum=MAX_WORLD_SIZE)
        if self.num_cpu_blocks > MAX_COUNT:
            raise ConfigError(
                f"num_cpu_blocks={self.num_cpu_blocks} (cpu_bytes_to_use={self.cpu_bytes_to_use} "
                f"// {self.kv_bytes_per_offloaded_block} bytes per offloaded block) is more "
                f"than {MAX_COUNT} blocks"
            )
        object.__setattr__(
            self, "rank", check_int("rank", self.rank, minimum=0, maximum=self.world_size - 1)
        )
        if self.instance_id is not None:
            check_name("instance_id", self.instance_id)
        check_text("spec_name", self.spec_name)
        if self.spec_module_path is not None:
            check_text("spec_module_path", self.spec_module_path)
        tiers: object = self.tiers
        if isinstance(tiers, str | bytes) or not isinstance(tiers, Sequence):
            raise ConfigError(f"tiers must be a sequence of tier configs, got {tiers!r}")
        for tier in tiers:
            if not isinstance(getattr(tier, "kind", None), str) or not tier.kind:
                raise ConfigError(
                    f"tiers entries must be tier configs (e.g. DiskTierConfig), got {tier!r}"
                )
        object.__setattr__(self, "tiers", tuple(tiers))

    def _int_field(self, name: str, *, minimum: int, maximum: int | None = None) -> None:
        """Check an int field and store it as a plain int (a numpy int becomes one)."""
        value = check_int(name, getattr(self, name), minimum=minimum, maximum=maximum)
        object.__setattr__(self, name, value)

    def _check_offloaded_block_size(self, value: int) -> None:
        self._int_field("offloaded_block_size", minimum=1, maximum=MAX_TOKENS_PER_BLOCK)
        distinct = sorted(set(self.gpu_block_sizes))
        if len(distinct) != 1:
            raise ConfigError(
                f"offloaded_block_size={value} needs every KV group to share one GPU "
                f"block size, but gpu_block_sizes={self.gpu_block_sizes!r}"
            )
        if value % distinct[0]:
            raise ConfigError(
                f"offloaded_block_size={value} is not a multiple of the GPU block "
                f"size {distinct[0]}"
            )

    @property
    def block_size_factor(self) -> int:
        """GPU blocks per offloaded block (1 unless ``offloaded_block_size`` is set)."""
        if self.offloaded_block_size is None:
            return 1
        return self.offloaded_block_size // self.gpu_block_sizes[0]

    @property
    def kv_bytes_per_offloaded_block(self) -> int:
        """CPU bytes one offloaded block takes, across every rank."""
        return self.kv_bytes_per_block * self.world_size * self.block_size_factor

    @property
    def num_cpu_blocks(self) -> int:
        """Offloaded blocks that fit in ``cpu_bytes_to_use`` (0 when blocks hold no bytes)."""
        per_block = self.kv_bytes_per_offloaded_block
        return self.cpu_bytes_to_use // per_block if per_block else 0

    @classmethod
    def from_dict(
        cls,
        extra: Mapping[str, Any],
        *,
        gpu_block_sizes: Sequence[int],
        hash_block_size: int,
        kv_bytes_per_block: int,
        world_size: int = 1,
        rank: int = 0,
        instance_id: str | None = None,
        enable_events: bool = False,
        strict: bool = False,
    ) -> OffloadConfig:
        """Build a config from vLLM's ``kv_connector_extra_config`` mapping.

        Integer values may be given as ints, integral floats (``1e9``) or
        numeric strings (``"8589934592"``), as vLLM's ``int(...)`` accepts.
        ``world_size``, ``rank`` and ``instance_id`` come from the engine (vLLM's
        parallel config and engine id), like the KV facts.
        ``"tiers"`` is a list of mappings, each with a ``"kind"`` (``"disk"``:
        the keywords of :class:`~aiokvo.tiers.DiskTierConfig`).
        Keys outside :data:`EXTRA_CONFIG_KEYS` are ignored, as vLLM does, but
        reported with :class:`UnknownConfigKeyWarning`; with ``strict=True``
        they raise :class:`~aiokvo.errors.ConfigError` instead.
        """
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"kv_connector_extra_config must be a mapping of keys to values, got {extra!r}"
            )
        unknown = sorted(str(k) for k in extra if k not in EXTRA_CONFIG_KEYS)
        if unknown:
            message = f"unknown kv_connector_extra_config keys {unknown}; known keys are " + (
                ", ".join(sorted(EXTRA_CONFIG_KEYS))
            )
            if strict:
                raise ConfigError(message)
            warnings.warn(message, UnknownConfigKeyWarning, stacklevel=2)

        if extra.get("cpu_bytes_to_use") is None:
            raise ConfigError("cpu_bytes_to_use must be specified in kv_connector_extra_config")
        block_size = extra.get("block_size")
        spec_module_path = extra.get("spec_module_path")
        tiers = extra.get("tiers", ())
        if isinstance(tiers, str | bytes | Mapping) or not isinstance(tiers, Sequence):
            raise ConfigError(f"tiers must be a list of tier settings, got {tiers!r}")
        from aiokvo.tiers.registry import tier_config_from_dict  # only when asked

        tier_configs = tuple(tier_config_from_dict(t) for t in tiers)
        return cls(
            gpu_block_sizes=tuple(gpu_block_sizes),
            hash_block_size=hash_block_size,
            cpu_bytes_to_use=parse_int("cpu_bytes_to_use", extra["cpu_bytes_to_use"]),
            kv_bytes_per_block=kv_bytes_per_block,
            offloaded_block_size=(
                None if block_size is None else parse_int("block_size", block_size)
            ),
            eviction_policy=_parse_str("eviction_policy", extra.get("eviction_policy", "lru")),
            store_threshold=parse_int("store_threshold", extra.get("store_threshold", 0)),
            max_tracker_size=parse_int("max_tracker_size", extra.get("max_tracker_size", 64_000)),
            recency=extra.get("recency", "touch"),
            store_counting=extra.get("store_counting", "lookups"),
            retention_fraction=_parse_fraction(
                "retention_fraction", extra.get("retention_fraction", 0.25)
            ),
            enable_events=enable_events,
            world_size=world_size,
            rank=rank,
            instance_id=instance_id,
            spec_name=_parse_str("spec_name", extra.get("spec_name", "CPUOffloadingSpec")),
            spec_module_path=(
                None
                if spec_module_path is None
                else _parse_str("spec_module_path", spec_module_path)
            ),
            tiers=tier_configs,
        )


def _parse_fraction(key: str, value: object) -> float:
    """A number in [0, 1], also from a numeric string (as vLLM's JSON config may give)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{key} must be a number in [0, 1], got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be a number in [0, 1], got {value!r}")
    return float(value)


def _parse_str(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value
