"""Tier kinds by name, for configs read from JSON (``OffloadConfig.from_dict``).

``{"kind": "disk", ...}`` becomes a :class:`~aiokvo.tiers.disk.DiskTierConfig`,
``{"kind": "mooncake", ...}`` a :class:`~aiokvo.tiers.mooncake.MooncakeTierConfig`;
another tier registers its config class with :func:`register_tier_kind`
(a ``"module:Class"`` path, imported on first use so configs stay cheap to
read). A config class has ``kind``, ``from_dict(mapping)`` and ``build()``
returning the :class:`~aiokvo.tiers.base.Tier`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

from aiokvo.errors import ConfigError

__all__ = ["TierConfig", "register_tier_kind", "tier_config_from_dict"]


class TierConfig(Protocol):
    """A tier's validated, frozen settings."""

    kind: str

    def build(self) -> Any: ...


_KINDS: dict[str, str] = {
    "disk": "aiokvo.tiers.disk.config:DiskTierConfig",
    "mooncake": "aiokvo.tiers.mooncake.config:MooncakeTierConfig",
}


def register_tier_kind(kind: str, path: str) -> None:
    """Make ``{"kind": kind}`` build the config class at ``path`` (``"module:Class"``)."""
    if not isinstance(kind, str) or not kind or not isinstance(path, str) or ":" not in path:
        raise ConfigError(
            f"register_tier_kind wants a kind and 'module:Class', got {kind!r}, {path!r}"
        )
    _KINDS[kind] = path


def tier_config_from_dict(settings: object) -> TierConfig:
    """The config of one tier from its mapping (``kind`` names the tier)."""
    if not isinstance(settings, Mapping):
        raise ConfigError(f"a tier's settings must be a mapping with a 'kind', got {settings!r}")
    kind = settings.get("kind")
    path = _KINDS.get(kind) if isinstance(kind, str) else None
    if path is None:
        raise ConfigError(f"unknown tier kind {kind!r}; known: {', '.join(sorted(_KINDS))}")
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    config: TierConfig = cls.from_dict(settings)
    return config
