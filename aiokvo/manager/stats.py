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

    Lookups (``lookup`` and ``lookup_prefix`` calls alike):

    * ``lookups``: calls; ``lookup_hits``: keys reported ready, summed;
    * ``lookup_misses``: calls that stopped at a key that is not offloaded;
    * ``lookup_in_flight``: calls answered ``None`` (a store still running).

    Loads: ``loads`` ``prepare_load`` calls pinning ``blocks_pinned`` keys in
    all. Stores: ``stores`` ``prepare_store`` calls, ``stores_refused`` of them
    answered ``None`` (no room); ``blocks_reserved`` keys reserved, of which
    ``blocks_stored`` were completed successfully and ``blocks_store_failed``
    released after a failed copy; ``blocks_evicted`` keys evicted to make room.

    The pool now: ``num_blocks`` in all, ``used_blocks`` held (ready or being
    written), ``free_blocks``, ``writing_blocks`` (stores in flight) and
    ``pinned_blocks`` (blocks with at least one pending load).

    A :class:`~aiokvo.manager.FilterReusedOffloadingManager` adds
    ``reuse_tracked_keys`` (keys in its counter now) and
    ``reuse_filtered_blocks`` (keys it kept from ``prepare_store``); for other
    managers both are 0. A manager that keeps no counters reports zeros.
    """

    num_blocks: int = 0
    used_blocks: int = 0
    free_blocks: int = 0
    writing_blocks: int = 0
    pinned_blocks: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    lookup_in_flight: int = 0
    loads: int = 0
    blocks_pinned: int = 0
    stores: int = 0
    stores_refused: int = 0
    blocks_reserved: int = 0
    blocks_stored: int = 0
    blocks_store_failed: int = 0
    blocks_evicted: int = 0
    reuse_tracked_keys: int = 0
    reuse_filtered_blocks: int = 0
