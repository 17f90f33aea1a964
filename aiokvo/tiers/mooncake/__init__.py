"""The distributed tier on Mooncake Store: engine replicas on many machines share blocks.

``MooncakeTier`` is what the Offloader is handed; ``MooncakeTierConfig`` its
settings (also from ``OffloadConfig.from_dict``). The pure parts
(``config``, ``spec``, ``state``) import without asyncio, torch or Mooncake;
Mooncake itself (``pip install 'aiokvo[mooncake]'``) loads only when a tier
connects. ``FakeMooncakeCluster`` stands in for a cluster in tests, and
``LocalCluster`` starts a real throwaway one on loopback (tests, the demo).
See docs/tiers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiokvo._util import lazy_export
from aiokvo.tiers.mooncake.config import MooncakeTierConfig
from aiokvo.tiers.mooncake.spec import MOONCAKE_MEDIUM, MooncakeLoadStoreSpec

if TYPE_CHECKING:
    from aiokvo.tiers.mooncake.fake import FakeMooncakeCluster, FakeMooncakeStore
    from aiokvo.tiers.mooncake.local import LocalCluster
    from aiokvo.tiers.mooncake.tier import MooncakeTier, MooncakeTierStatistics

__all__ = [
    "MOONCAKE_MEDIUM",
    "FakeMooncakeCluster",
    "FakeMooncakeStore",
    "LocalCluster",
    "MooncakeLoadStoreSpec",
    "MooncakeTier",
    "MooncakeTierConfig",
    "MooncakeTierStatistics",
]

_LAZY = {
    "FakeMooncakeCluster": "aiokvo.tiers.mooncake.fake",
    "FakeMooncakeStore": "aiokvo.tiers.mooncake.fake",
    "LocalCluster": "aiokvo.tiers.mooncake.local",
    "MooncakeTier": "aiokvo.tiers.mooncake.tier",
    "MooncakeTierStatistics": "aiokvo.tiers.mooncake.tier",
}


def __getattr__(name: str) -> Any:
    return lazy_export(globals(), _LAZY, name)
