"""A transfer copies the blocks that were checked, whatever the caller's arrays do later.

The host backend validates a spec's block ids in ``transfer_async`` and copies
on its dispatch thread afterwards. When the spec kept the caller's array, a
caller that reused that array (refilling it for the next request) redirected
an already-validated store to blocks nobody checked, and the result still said
success. Specs now own a read-only copy of their ids.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from aiokvo.handlers.host import HostOffloadingHandler
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
