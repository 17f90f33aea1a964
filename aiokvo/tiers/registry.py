"""Tier kinds by name, for configs read from JSON (``OffloadConfig.from_dict``).

``{"kind": "disk", ...}`` becomes a :class:`~aiokvo.tiers.disk.DiskTierConfig`,
``{"kind": "mooncake", ...}`` a :class:`~aiokvo.tiers.mooncake.MooncakeTierConfig`,
and :func:`build_tier` makes the tier a config describes. Another tier
registers its config class and its factory with :func:`register_tier_kind`
(``"module:name"`` paths, imported on first use: configs stay cheap to read,
and the pure configs never import the tiers, which sit above them). A
config class has ``kind`` and ``from_dict(mapping)``; a factory takes the
config and returns the :class:`~aiokvo.tiers.base.Tier`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

from aiokvo.errors import ConfigError

__all__ = ["TierConfig", "build_tier", "register_tier_kind", "tier_config_from_dict"]


class TierConfig(Protocol):
    """A tier's validated, frozen settings."""

    kind: str


_KINDS: dict[str, tuple[str, str]] = {
    "disk": ("aiokvo.tiers.disk.config:DiskTierConfig", "aiokvo.tiers.disk.tier:disk_tier"),
    "mooncake": (
        "aiokvo.tiers.mooncake.config:MooncakeTierConfig",
        "aiokvo.tiers.mooncake.tier:mooncake_tier",
    ),
}


def register_tier_kind(kind: str, config: str, factory: str) -> None:
    """Make ``{"kind": kind}`` read into the config class at ``config`` and build its
    tier with the function at ``factory`` (both ``"module:name"``)."""
    ok = isinstance(kind, str) and bool(kind) and all(
        isinstance(path, str) and ":" in path for path in (config, factory)
    )
    if not ok:
        raise ConfigError(
            "register_tier_kind wants a kind and two 'module:name' paths, got "
            f"{kind!r}, {config!r}, {factory!r}"
        )
    _KINDS[kind] = (config, factory)


def build_tier(config: TierConfig) -> Any:
    """The tier ``config`` describes, made by its kind's factory."""
    kind = getattr(config, "kind", None)
    paths = _KINDS.get(kind) if isinstance(kind, str) else None
    if paths is None:
        raise ConfigError(f"unknown tier kind {kind!r}; known: {', '.join(sorted(_KINDS))}")
    return _load(paths[1])(config)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def tier_config_from_dict(settings: object) -> TierConfig:
    """The config of one tier from its mapping (``kind`` names the tier)."""
    if not isinstance(settings, Mapping):
        raise ConfigError(f"a tier's settings must be a mapping with a 'kind', got {settings!r}")
    kind = settings.get("kind")
    paths = _KINDS.get(kind) if isinstance(kind, str) else None
    if paths is None:
        raise ConfigError(f"unknown tier kind {kind!r}; known: {', '.join(sorted(_KINDS))}")
    config: TierConfig = _load(paths[0]).from_dict(settings)
    return config
