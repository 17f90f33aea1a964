"""Reading JSON-style settings: vLLM's ``kv_connector_extra_config`` and the tiers in it.

Engines hand configuration over as JSON, where a byte count arrives as
``"8589934592"`` or ``8e9`` and a deadline as ``"2.5"``. One set of readers
turns such values into the ints and seconds the config dataclasses check,
so :meth:`~aiokvo.OffloadConfig.from_dict` and every tier config's
``from_dict`` accept the same spellings and reject the rest with the same
:class:`~aiokvo.errors.ConfigError`. Pure (no asyncio, no torch).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from aiokvo.errors import ConfigError

__all__ = ["check_keys", "check_seconds", "parse_int", "parse_seconds", "settings_from_dict"]

_C = TypeVar("_C")


def parse_int(key: str, value: object) -> int:
    """An int from a config value the way vLLM's ``int(value)`` reads it, minus surprises:
    ints, integral floats (``8e9``) and numeric strings, never ``bool``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{key} must be an integer, got {value!r}")


def parse_seconds(key: str, value: str) -> float:
    """Seconds from a numeric string (``"2.5"``); :func:`check_seconds` checks the range."""
    try:
        return float(value.strip())
    except ValueError:
        raise ConfigError(f"{key} must be a number of seconds, got {value!r}") from None


def check_seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    """``value`` as float seconds: a finite number, > 0 (or >= 0), not a ``bool``."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_keys(cls: type, settings: Mapping[str, Any], what: str) -> None:
    """A ConfigError for a key of ``settings`` that is not a field of the dataclass
    ``cls`` (``kind`` aside: it names a tier), or a required field left out."""
    every = fields(cls)
    known = {f.name for f in every}
    unknown = sorted(str(k) for k in settings if k not in known and k != "kind")
    if unknown:
        raise ConfigError(f"unknown {what} settings {unknown}; known: {', '.join(sorted(known))}")
    missing = sorted(
        f.name
        for f in every
        if f.default is MISSING and f.default_factory is MISSING and f.name not in settings
    )
    if missing:
        raise ConfigError(f"missing {what} settings: {', '.join(missing)} must be given")


def settings_from_dict(
    cls: type[_C],
    settings: Mapping[str, Any],
    what: str,
    *,
    ints: Collection[str] = (),
    seconds: Collection[str] = (),
) -> _C:
    """``cls(**settings)`` for a settings dataclass, from a JSON-style mapping.

    ``kind`` may be present (it names the tier); any other key that is not a
    field is a :class:`~aiokvo.errors.ConfigError` naming it and listing the
    known ones (``what`` says whose: ``"disk tier"``), and so is a required
    field left out (not a ``TypeError`` from the constructor). String and float
    values of the ``ints`` fields are parsed with :func:`parse_int`, string
    values of the ``seconds`` fields with :func:`parse_seconds`; the
    dataclass checks everything else itself.
    """
    check_keys(cls, settings, what)
    values = {k: v for k, v in settings.items() if k != "kind"}
    for key in ints:
        if isinstance(values.get(key), str | float):
            values[key] = parse_int(key, values[key])
    for key in seconds:
        if isinstance(values.get(key), str):
            values[key] = parse_seconds(key, values[key])
    return cls(**values)
