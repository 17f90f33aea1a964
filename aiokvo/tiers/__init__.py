"""Tiers below the CPU pool: the protocol the Offloader drives, and the tiers.

``Tier`` (the protocol), ``TierStatistics``, ``CircuitBreaker``,
``LayoutFingerprint``, the disk tier (``DiskTier``, ``DiskTierConfig``) and the
Mooncake tier (``MooncakeTier``, ``MooncakeTierConfig``).
Names load lazily, so the pure parts (:mod:`aiokvo.tiers.base`, ``core``,
``index``, ``slot_index``, ``seen_index``, ``outcome``, ``settings``,
``breaker``, ``admission``, ``fingerprint``) import without asyncio or torch
(tests/tiers/test_pure.py checks). See docs/tiers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiokvo._util import lazy_export

if TYPE_CHECKING:
    from aiokvo.tiers.admission import Admission
    from aiokvo.tiers.base import Tier, TierBinding, TierLoad, TierStatistics, TierStore
    from aiokvo.tiers.breaker import BreakerStatistics, CircuitBreaker
    from aiokvo.tiers.disk import DiskLoadStoreSpec, DiskTier, DiskTierConfig, DiskTierStatistics
    from aiokvo.tiers.disk.files import FileIO
    from aiokvo.tiers.fingerprint import LayoutFingerprint
    from aiokvo.tiers.mooncake import MooncakeTier, MooncakeTierConfig, MooncakeTierStatistics
    from aiokvo.tiers.registry import build_tier, register_tier_kind, tier_config_from_dict

__all__ = [
    "Admission",
    "BreakerStatistics",
    "CircuitBreaker",
    "DiskLoadStoreSpec",
    "DiskTier",
    "DiskTierConfig",
    "DiskTierStatistics",
    "FileIO",
    "LayoutFingerprint",
    "MooncakeTier",
    "MooncakeTierConfig",
    "MooncakeTierStatistics",
    "Tier",
    "TierBinding",
    "TierLoad",
    "TierStatistics",
    "TierStore",
    "build_tier",
    "register_tier_kind",
    "tier_config_from_dict",
]

_WHERE = {
    "Admission": "aiokvo.tiers.admission",
    "BreakerStatistics": "aiokvo.tiers.breaker",
    "CircuitBreaker": "aiokvo.tiers.breaker",
    "DiskLoadStoreSpec": "aiokvo.tiers.disk.spec",
    "DiskTier": "aiokvo.tiers.disk.tier",
    "DiskTierConfig": "aiokvo.tiers.disk.config",
    "DiskTierStatistics": "aiokvo.tiers.disk.store",
    "FileIO": "aiokvo.tiers.disk.files",
    "LayoutFingerprint": "aiokvo.tiers.fingerprint",
    "MooncakeTier": "aiokvo.tiers.mooncake.tier",
    "MooncakeTierConfig": "aiokvo.tiers.mooncake.config",
    "MooncakeTierStatistics": "aiokvo.tiers.mooncake.store",
    "Tier": "aiokvo.tiers.base",
    "TierBinding": "aiokvo.tiers.base",
    "TierLoad": "aiokvo.tiers.base",
    "TierStatistics": "aiokvo.tiers.base",
    "TierStore": "aiokvo.tiers.base",
    "build_tier": "aiokvo.tiers.registry",
    "register_tier_kind": "aiokvo.tiers.registry",
    "tier_config_from_dict": "aiokvo.tiers.registry",
}


def __getattr__(name: str) -> Any:
    return lazy_export(globals(), _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
