"""What a manager has done and holds, as one frozen snapshot.

Exporters (``aiokvo.telemetry``) read these; the manager only bumps plain
int counters, once per call and never once per key, so that counting costs
the hot path a few additions. Everything that describes the pool *now*
(used, free, pinned, writing) is computed when the snapshot is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ManagerStatistics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerStatistics:
    """A manager's counters since it was made, and its pool at this instant.

    The lookup fields count ``lookup`` and ``lookup_prefix`` calls alike. A
    manager that keeps no counters reports zeros.
    """

    num_blocks: int = 0
    """Blocks in the pool, in all."""
    used_blocks: int = 0
    """Blocks held now (ready or being written)."""
    free_blocks: int = 0
    """Blocks free now."""
    writing_blocks: int = 0
    """Blocks being written now (stores in flight)."""
    pinned_blocks: int = 0
    """Blocks with at least one pending load now."""
    lookups: int = 0
    """Lookup calls."""
    lookup_hits: int = 0
    """Keys lookups reported ready, summed."""
    lookup_misses: int = 0
    """Lookup calls that stopped at a key that is not offloaded."""
    lookup_in_flight: int = 0
    """Lookup calls answered ``None`` (a store still running)."""
    loads: int = 0
    """``prepare_load`` calls."""
    blocks_pinned: int = 0
    """Keys those ``prepare_load`` calls pinned, in all."""
    stores: int = 0
    """``prepare_store`` calls."""
    stores_refused: int = 0
    """``prepare_store`` calls answered ``None`` (no room)."""
    blocks_reserved: int = 0
    """Keys ``prepare_store`` reserved."""
    blocks_stored: int = 0
    """Reserved keys whose store completed successfully."""
    blocks_store_failed: int = 0
    """Reserved keys released after a failed copy."""
    blocks_evicted: int = 0
    """Keys evicted to make room."""
    reuse_tracked_keys: int = 0
    """Keys in a :class:`~aiokvo.manager.FilterReusedOffloadingManager`'s counter now
    (0 for other managers)."""
    reuse_filtered_blocks: int = 0
    """Keys a :class:`~aiokvo.manager.FilterReusedOffloadingManager` kept from
    ``prepare_store`` (0 for other managers)."""
