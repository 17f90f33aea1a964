"""What a submitted host transfer holds on to until its copy has really run.

* The block ids it was checked with: the host backend validates a spec's ids in
  ``transfer_async`` and copies on its dispatch thread afterwards. When the spec
  kept the caller's array, a caller that reused that array (refilling it for the
  next request) redirected an already-validated store to blocks nobody checked,
  and the result still said success. Specs now own a read-only copy of their ids.
* Its result: closing the event poller used to report in-flight transfers as
  failed at once, while their copies were still writing, so a caller that freed
  those blocks raced the copy. A transfer is now reported when its copy stops.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from aiokvo.handlers.host import HostOffloadingHandler
from aiokvo.runtime.poller import EventPoller
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tests.handlers.host.test_assist import NUM_BLOCKS, PAGE, StalledThreads, _caches


async def test_changing_the_callers_arrays_after_submission_changes_nothing() -> None:
    caches = _caches()
    stalled = StalledThreads()  # the copy runs only once the test opens the gate
    dispatcher = stalled.dispatcher()
    pool = torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.int8)
    store = HostOffloadingHandler(
        caches, [pool], block_size_factor=1, gpu_to_cpu=True, dispatcher=dispatcher,
        inline_after=None,
    )
    try:
        gpu_ids = np.array([2, 5], dtype=np.int64)
        cpu_ids = np.array([3, 4], dtype=np.int64)
        spec = (GPULoadStoreSpec(gpu_ids, [2], [0]), CPULoadStoreSpec(cpu_ids))
        task = store.transfer_async(1, spec)
        gpu_ids[:] = [7, 8]  # the caller reuses its arrays for the next request
        cpu_ids[:] = [10, 11]
        stalled.gate.set()
        result = await asyncio.wait_for(task, 10)
        assert result.success
        gpu = caches.tensors[0].tensor
        assert torch.equal(pool[3], gpu[2]) and torch.equal(pool[4], gpu[5])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (3, 4)]
        assert not pool[untouched].any()
    finally:
        stalled.gate.set()
        await store.aclose()
        dispatcher.shutdown()


async def test_closing_the_poller_reports_a_transfer_only_after_its_copy() -> None:
    caches = _caches()
    stalled = StalledThreads()
    dispatcher = stalled.dispatcher()
    pool = torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.int8)
    store = HostOffloadingHandler(
        caches, [pool], block_size_factor=1, gpu_to_cpu=True, dispatcher=dispatcher,
        inline_after=None,
    )
    try:
        task = store.transfer_async(1, (GPULoadStoreSpec([2], [1], [0]), CPULoadStoreSpec([3])))
        EventPoller.current().close()  # e.g. aiokvo.run finishing with copies in flight
        await asyncio.sleep(0.05)
        assert not task.done()  # the copy has not run: it must not look finished
        assert not pool.any()
        stalled.gate.set()
        result = await asyncio.wait_for(task, 10)
        assert result.success  # the copy's own outcome
        assert torch.equal(pool[3], caches.tensors[0].tensor[2])
        # New transfers go to the loop's next poller.
        follow = store.transfer_async(2, (GPULoadStoreSpec([4], [1], [0]), CPULoadStoreSpec([5])))
        assert (await asyncio.wait_for(follow, 10)).success
    finally:
        stalled.gate.set()
        await store.aclose()
        dispatcher.shutdown()
