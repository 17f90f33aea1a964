"""The counters a tier's core keeps: every counter field of :class:`TierStatistics`.

The names come from the snapshot itself, so a counter added there (with its
one-line doc) is kept here, reported by ``statistics()`` and exported to
Prometheus with no further edit: one place, not three. What is not counted
here is read from its owner when the snapshot is taken (the index's
occupancy and evictions, the breaker, the connection, the causes). Pure.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from aiokvo.tiers.base import TierStatistics

__all__ = ["COUNTER_FIELDS", "TierCounters"]

_NOT_COUNTED = frozenset({
    "medium", "capacity_blocks", "used_blocks", "capacity_bytes", "used_bytes", "connected",
    "evictions", "removals",
    "failure_causes", "breaker",
})  # fmt: skip

COUNTER_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(TierStatistics) if f.name not in _NOT_COUNTED
)
"""The :class:`TierStatistics` fields a :class:`TierCounters` fills."""

_FLOATS = frozenset(f.name for f in fields(TierStatistics) if f.type in ("float", float))


class TierCounters:
    """Plain attribute counters (int adds on the loop's thread), one per counter field."""

    def __init__(self) -> None:
        for name in COUNTER_FIELDS:
            setattr(self, name, 0.0 if name in _FLOATS else 0)

    def counters(self) -> dict[str, Any]:
        """The counters now, as keyword arguments for a ``TierStatistics``."""
        return {name: getattr(self, name) for name in COUNTER_FIELDS}

    # Declared for type checkers: every COUNTER_FIELDS name is an attribute.
    connects: int
    connect_failures: int
    lookups: int
    lookup_hits: int
    lookup_misses: int
    lookups_bypassed: int
    remote_lookups: int
    lookup_failures: int
    lookup_timeouts: int
    reads: int
    blocks_read: int
    read_failures: int
    bytes_read: int
    read_seconds: float
    offers: int
    admitted: int
    writes: int
    blocks_written: int
    write_failures: int
    writes_refused: int
    bytes_written: int
    write_seconds: float
    checksum_failures: int
    stale_reads: int
    timeouts: int
    store_failures: int
    abandoned: int
