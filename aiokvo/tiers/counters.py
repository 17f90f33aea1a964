"""The counters every tier's state machine keeps, named as :class:`TierStatistics` fields.

Both built-in tiers count lookups, reads and writes the same way; keeping
the names in one place means a tier's ``statistics()`` cannot drift from
the shared snapshot (or from the Prometheus families read from it). Pure:
no imports, so the tiers' sans-I/O parts stay importable anywhere.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COUNTER_FIELDS", "TierCounters"]

COUNTER_FIELDS = (
    "lookups", "lookup_hits", "lookup_misses", "lookups_bypassed",
    "reads", "blocks_read", "read_failures", "bytes_read", "read_seconds",
    "offers", "admitted", "writes", "blocks_written", "write_failures", "writes_refused",
    "bytes_written", "write_seconds", "timeouts",
)  # fmt: skip
"""The :class:`~aiokvo.tiers.TierStatistics` fields a :class:`TierCounters` fills."""


class TierCounters:
    """Lookups, reads, writes and timeouts, counted by a tier state machine (plain int adds)."""

    def __init__(self) -> None:
        self.lookups = self.lookup_hits = self.lookup_misses = self.lookups_bypassed = 0
        self.reads = self.blocks_read = self.read_failures = self.bytes_read = 0
        self.writes = self.blocks_written = self.write_failures = self.bytes_written = 0
        self.offers = self.admitted = self.writes_refused = self.timeouts = 0
        self.read_seconds = self.write_seconds = 0.0

    def counters(self) -> dict[str, Any]:
        """The counters now, as keyword arguments for a ``TierStatistics``."""
        return {name: getattr(self, name) for name in COUNTER_FIELDS}
