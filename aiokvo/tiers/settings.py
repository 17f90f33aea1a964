"""``TierSettings``: what every tier is configured with, checked once (pure data).

Every tier names its bytes (``model_id``, ``dtype``: part of the layout
fingerprint), admits blocks after some offers, bounds its I/O with a
deadline, trips a circuit breaker on failures in a row, bounds what it
tracks and how much of the CPU pool its writes may pin. A tier's own config
is a subclass that adds only its own fields (:class:`~aiokvo.tiers.disk.
DiskTierConfig`: a directory and a size; :class:`~aiokvo.tiers.mooncake.
MooncakeTierConfig`: a master address), and the engine
(:class:`~aiokvo.tiers.engine.StoreTier`) takes the settings whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from aiokvo._settings import check_keys, check_seconds, settings_from_dict
from aiokvo._util import check_int, check_text
from aiokvo.errors import ConfigError

__all__ = ["MAX_BYTES", "TierSettings"]

_S = TypeVar("_S", bound="TierSettings")

MAX_BYTES = 1 << 50
"""The most a byte count may be (1 PiB): past it, a value is a typo, not a memory or disk."""

MAX_TRACKED = 1 << 26
"""Keys a tier may be asked to track (admission counts, indexes): ~64 M, far past any
pool, and small enough that a typo of a few digits is caught here."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSettings:
    """The settings every tier has; a tier's config subclasses it (docs/tiers.md, "Knobs")."""

    model_id: str
    """Names the model whose bytes these are: part of the layout fingerprint."""
    dtype: str | None = None
    """The KV dtype in the fingerprint; default: the engine's (refused if unknown)."""
    admit_after: int = 1
    """Offers of a block before it is written to the tier (1: every block)."""
    io_timeout: float = 10.0
    """Seconds one transfer may take, queueing included; later is a failure."""
    failure_threshold: int = 3
    """Failures in a row that open the circuit breaker."""
    reset_after: float = 5.0
    """Seconds the breaker stays open before one trial, doubled while trials fail."""
    max_reset_after: float = 60.0
    """The longest the breaker stays open."""
    max_tracked: int = 64_000
    """Keys tracked at most by admission counts and indexes (oldest forgotten first)."""
    max_write_blocks: int | None = None
    """CPU blocks pinned by this tier's writes in flight at most (None: half the pool)."""
    read_slots: int = 4
    """Reads (promotions, prefetches) in flight at once, each on its own thread: one
    stalled or large read never holds up another request's."""

    kind: ClassVar[str] = ""
    _ints: ClassVar[tuple[str, ...]] = (
        "admit_after", "failure_threshold", "max_tracked", "max_write_blocks", "read_slots",
    )  # fmt: skip
    _seconds: ClassVar[tuple[str, ...]] = ("io_timeout", "reset_after", "max_reset_after")

    def __post_init__(self) -> None:
        check_text("model_id", self.model_id, printable=True)
        if self.dtype is not None:
            check_text("dtype", self.dtype, printable=True)
        self._set("admit_after", check_int("admit_after", self.admit_after, minimum=1))
        for name in TierSettings._seconds:
            self._set(name, check_seconds(name, getattr(self, name)))
        self._set("failure_threshold",
                  check_int("failure_threshold", self.failure_threshold, minimum=1))  # fmt: skip
        self._set("max_tracked",
                  check_int("max_tracked", self.max_tracked, minimum=1, maximum=MAX_TRACKED))
        self._set("read_slots", check_int("read_slots", self.read_slots, minimum=1, maximum=64))
        if self.max_write_blocks is not None:
            self._set("max_write_blocks",
                      check_int("max_write_blocks", self.max_write_blocks, minimum=1))
        if self.max_reset_after < self.reset_after:
            raise ConfigError(
                f"max_reset_after={self.max_reset_after!r} is below "
                f"reset_after={self.reset_after!r}"
            )

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @classmethod
    def _int_fields(cls) -> tuple[str, ...]:
        """Fields read as integers from JSON (a subclass adds its own to ``_ints``)."""
        return tuple(dict.fromkeys((*TierSettings._ints, *cls._ints)))

    @classmethod
    def _seconds_fields(cls) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*TierSettings._seconds, *cls._seconds)))

    @classmethod
    def of(cls: type[_S], **values: Any) -> _S:
        """``cls(**values)``, with an unknown or missing setting a ConfigError naming it
        (as :meth:`from_dict`, but values are taken as given)."""
        check_keys(cls, values, f"{cls.kind or 'tier'} tier")
        return cls(**values)

    @classmethod
    def from_dict(cls: type[_S], settings: Mapping[str, Any]) -> _S:
        """From a JSON-style mapping (``kind`` may be present); unknown keys are errors.

        Integers and seconds may be numeric strings, as in vLLM's extra config.
        """
        return settings_from_dict(
            cls, settings, f"{cls.kind or 'tier'} tier",
            ints=cls._int_fields(), seconds=cls._seconds_fields(),
        )  # fmt: skip
