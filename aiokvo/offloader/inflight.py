"""``InFlight``: one copy the Offloader has submitted and not yet completed.

Two kinds of coroutine wait for a copy. The call that started it awaits
:attr:`InFlight.caller` directly: cancelling that call cancels only this
future, which nobody else uses, so no shield is needed on the hot path.
Everyone else (``ready``, a load waiting for a store, ``drain``,
``aclose``) waits on :meth:`InFlight.ended`, made on first use and only ever
waited on with ``asyncio.wait``, which never cancels what it waits for.
Both are resolved by :meth:`InFlight.finish`, after the manager's
``complete_*`` has run.
"""

from __future__ import annotations

import asyncio

from aiokvo.specs import TransferResult

__all__ = ["InFlight"]


class InFlight:
    """A submitted copy: the caller's future, and one for other waiters on demand."""

    __slots__ = ("_ended", "_result", "caller", "patience")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.caller: asyncio.Future[TransferResult] = loop.create_future()
        self._ended: asyncio.Future[TransferResult] | None = None
        self._result: TransferResult | None = None  # once finished
        # How long anyone but its caller waits for it: a tier transfer's deadline (None:
        # until it ends, as a GPU <-> CPU copy always does).
        self.patience: float | None = None

    def ended(self) -> asyncio.Future[TransferResult]:
        """Resolves with the copy's result once it is completed; wait with ``asyncio.wait``.

        Asked for after the copy finished, it is already resolved (a tier's
        promotion can end while the load that started it awaits the next tier).
        """
        if self._ended is None:
            self._ended = self.caller.get_loop().create_future()
            if self._result is not None:
                self._ended.set_result(self._result)
        return self._ended

    def finish(self, result: TransferResult) -> None:
        """The copy ended and the manager was told: wake everyone."""
        self._result = result
        if not self.caller.done():  # else the caller was cancelled and has gone
            self.caller.set_result(result)
        if self._ended is not None:
            self._ended.set_result(result)
