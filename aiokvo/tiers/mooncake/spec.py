"""What a Mooncake transfer names: blocks as cluster objects (pure data).

A :class:`MooncakeLoadStoreSpec` is the cluster side of a ``(CPU, MOONCAKE)``
or ``(MOONCAKE, CPU)`` transfer: for each block its key and its object name
(``where[i]``), and the :class:`~aiokvo.tiers.outcome.Outcomes` the store
fills from what Mooncake answered per object.
"""

from __future__ import annotations

from aiokvo.tiers.spec import TierSpec

__all__ = ["MOONCAKE_MEDIUM", "MooncakeLoadStoreSpec"]

MOONCAKE_MEDIUM = "MOONCAKE"


class MooncakeLoadStoreSpec(TierSpec):
    """Blocks in a Mooncake cluster: ``keys[i]`` is the object ``where[i]``."""

    __slots__ = ()
    MEDIUM = MOONCAKE_MEDIUM

    @property
    def names(self) -> tuple[str, ...]:
        """The objects' names (``where``)."""
        return self.where
