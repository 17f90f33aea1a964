"""What a tier transfer names on the tier's side: blocks, where each lives, how each went.

Pure data. A :class:`TierSpec` is one side of a ``(CPU, <medium>)`` or
``(<medium>, CPU)`` transfer: for each block its key and its place in the
store (``where[i]``: whatever the tier's index hands its store, a slab slot
or an object name), and the :class:`~aiokvo.tiers.outcome.Outcomes` the
store fills. The worker routes transfers by the spec's medium, so each
medium has its own subclass (:func:`spec_class`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from aiokvo.errors import InvalidSpecError
from aiokvo.keys import OffloadKey
from aiokvo.specs import LoadStoreSpec
from aiokvo.tiers.outcome import Outcomes

__all__ = ["TierSpec", "spec_class"]

_CLASSES: dict[str, type[TierSpec]] = {}


class TierSpec(LoadStoreSpec):
    """Blocks of one tier: ``keys[i]`` at ``where[i]``; ``outcomes`` says how each went."""

    __slots__ = ("keys", "outcomes", "where")

    MEDIUM: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.MEDIUM:
            _CLASSES.setdefault(cls.MEDIUM, cls)

    def __init__(self, keys: Sequence[OffloadKey], where: Sequence[Any]) -> None:
        if len(keys) != len(where):
            raise InvalidSpecError(
                f"a {self.MEDIUM} spec needs one place per key: {len(keys)} keys, "
                f"{len(where)} places"
            )
        self.keys: tuple[OffloadKey, ...] = tuple(keys)
        self.where: tuple[Any, ...] = tuple(where)
        self.outcomes = Outcomes(len(self.keys))

    @classmethod
    def medium(cls) -> str:
        return cls.MEDIUM

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.keys)} blocks)"


def spec_class(medium: str) -> type[TierSpec]:
    """The :class:`TierSpec` subclass of ``medium`` (one per medium, made on first use)."""
    cls = _CLASSES.get(medium)
    if cls is None:
        name = f"{medium.title().replace('_', '')}LoadStoreSpec"
        cls = type(name, (TierSpec,), {"__slots__": (), "MEDIUM": medium})
    return _CLASSES[medium]
