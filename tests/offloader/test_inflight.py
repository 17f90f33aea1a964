"""InFlight: every waiter sees the copy end, however late it asks."""

from __future__ import annotations

import asyncio

from aiokvo.offloader.inflight import InFlight
from aiokvo.specs import TransferResult


async def test_ended_asked_for_after_finish_is_already_resolved() -> None:
    copy = InFlight(asyncio.get_running_loop())
    early = copy.ended()
    result = TransferResult(job_id=1, success=True)
    copy.finish(result)
    late = copy.ended()
    assert early.done() and late.done()
    assert late.result() is result and copy.caller.result() is result
    done, pending = await asyncio.wait([late], timeout=0)
    assert done == {late} and not pending


async def test_ended_first_asked_for_after_finish_resolves_too() -> None:
    copy = InFlight(asyncio.get_running_loop())
    result = TransferResult(job_id=2, success=False)
    copy.finish(result)
    assert copy.ended().done() and copy.ended().result() is result
