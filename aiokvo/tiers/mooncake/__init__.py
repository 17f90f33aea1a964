"""The distributed tier on Mooncake Store: engine replicas on many machines share blocks.

``MooncakeTier(...)`` makes what the Offloader is handed (a
:class:`~aiokvo.tiers.engine.StoreTier` over a
:class:`~aiokvo.tiers.mooncake.store.MooncakeStore`); ``MooncakeTierConfig``
is its settings (also from ``OffloadConfig.from_dict``). The pure parts
(``config``, ``spec``) import without asyncio, torch or Mooncake;
Mooncake itself (``pip install 'aiokvo[mooncake]'``) loads only when a tier
connects. For tests, :mod:`aiokvo.testing` has ``FakeMooncakeCluster`` (an
in-process stand-in) and ``LocalCluster`` (a real throwaway cluster on
loopback). See docs/tiers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiokvo._util import lazy_export
from aiokvo.tiers.mooncake.config import MooncakeTierConfig
from aiokvo.tiers.mooncake.spec import MOONCAKE_MEDIUM, MooncakeLoadStoreSpec

if TYPE_CHECKING:
    from aiokvo.tiers.mooncake.store import MooncakeStore, MooncakeTierStatistics
    from aiokvo.tiers.mooncake.tier import MooncakeTier

__all__ = [
    "MOONCAKE_MEDIUM",
    "MooncakeLoadStoreSpec",
    "MooncakeStore",
    "MooncakeTier",
    "MooncakeTierConfig",
    "MooncakeTierStatistics",
]

_LAZY = {
    "MooncakeStore": "aiokvo.tiers.mooncake.store",
    "MooncakeTier": "aiokvo.tiers.mooncake.tier",
    "MooncakeTierStatistics": "aiokvo.tiers.mooncake.store",
}


def __getattr__(name: str) -> Any:
    return lazy_export(globals(), _LAZY, name)
