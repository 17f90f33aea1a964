"""``async with`` for everything in aiokvo that owns threads, streams or memory."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncResource"]


class AsyncResource:
    """``async with x:`` returns ``x`` and awaits ``x.aclose()`` on the way out.

    One mixin instead of the same two methods in every resource class; it
    has no state (empty ``__slots__``), so slotted classes stay slotted.
    """

    __slots__ = ()

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
