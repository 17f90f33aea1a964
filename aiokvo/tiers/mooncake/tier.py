"""``MooncakeTier``: a distributed tier on Mooncake Store, shared by engine replicas.

Hand it to the Offloader (``Offloader(config, kv, tiers=[MooncakeTier(
"127.0.0.1:50051", model_id=...)])``, or ``{"kind": "mooncake", ...}`` in
``OffloadConfig.from_dict``'s ``tiers``): a :class:`~aiokvo.tiers.engine.
StoreTier` over a :class:`~aiokvo.tiers.mooncake.store.MooncakeStore`. Every
engine replica configured with the same cluster, model and layout finds the
blocks the others stored.

Liveness (the engine's, for a store that connects and probes): opening never
fails for an unreachable cluster; the tier starts disconnected and a
background task connects when it can (with backoff). While disconnected, or
while the breaker is open, lookups answer 0 and stores skip the tier: the
CPU (and disk) tiers serve on. The breaker's half-open trial is the tier's
own probe (one ``batch_is_exist``), never a caller's lookup. docs/tiers.md,
"Mooncake", has the failure table.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.mooncake.client import StoreFactory
from aiokvo.tiers.mooncake.config import MooncakeTierConfig
from aiokvo.tiers.mooncake.store import MooncakeStore, MooncakeTierStatistics

__all__ = ["MooncakeTier", "MooncakeTierStatistics", "mooncake_tier"]


def MooncakeTier(
    master_server_addr: str,
    *,
    store_factory: StoreFactory | None = None,
    clock: Callable[[], float] = time.monotonic,
    **settings: Any,
) -> StoreTier:
    """A tier in the Mooncake cluster whose master is ``master_server_addr`` (``host:port``).

    ``settings`` are :class:`~aiokvo.tiers.mooncake.MooncakeTierConfig`'s
    (``model_id`` required); an unknown one is a ConfigError naming it.
    ``store_factory`` makes the Mooncake store object (tests pass
    :meth:`FakeMooncakeCluster.store <aiokvo.testing.mooncake_fake.FakeMooncakeCluster.store>`);
    ``clock`` is the breaker's and the caches' clock.
    """
    config = MooncakeTierConfig.of(master_server_addr=master_server_addr, **settings)
    return mooncake_tier(config, store_factory=store_factory, clock=clock)


def mooncake_tier(
    config: MooncakeTierConfig,
    *,
    store_factory: StoreFactory | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StoreTier:
    """A Mooncake tier with ``config``'s settings."""
    return StoreTier(MooncakeStore(config, store_factory=store_factory), config, clock=clock)
