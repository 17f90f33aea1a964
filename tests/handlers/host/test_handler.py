"""The host backend and the handler pair: byte-exact round trips, ordering, faults, closing."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from aiokvo.errors import (
    ConfigError,
    CudaUnavailableError,
    HandlerClosedError,
    LayoutError,
    TransferSpecError,
)
from aiokvo.handlers import CpuGpuHandlers, make_cpu_gpu_handlers
from aiokvo.handlers.host import (
    SPLIT_MIN_BYTES,
    HostCopy,
    HostOffloadingHandler,
    apply_host_copies,
)
from aiokvo.handlers.host.copies import page_elements, page_voids, page_words, split_by_part
from aiokvo.keys import make_offload_key
from aiokvo.layout import CanonicalKVCaches
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, ReqContext

NUM_GPU_BLOCKS = 24


def _kv_caches(layout: str, layers_per_group: Sequence[int], page_elems: int = 24):
    """Random bf16 KV layers, grouped; returns the raw layers and the canonical caches."""
    gen = torch.Generator().manual_seed(1234)
    groups = []
    for n in layers_per_group:
        shape = (NUM_GPU_BLOCKS, 2, page_elems) if layout == "blocks_first" else None
        if layout == "kv_first":
            shape = (2, NUM_GPU_BLOCKS, 2, page_elems)
        assert shape is not None
        groups.append([torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(n)])
    return groups, CanonicalKVCaches.from_engine(groups, layout=layout)  # type: ignore[arg-type]


def _expected_cpu_pages(
    gpu_spec: GPULoadStoreSpec, cpu_ids: Sequence[int], factor: int
) -> list[list[tuple[int, int, int]]]:
    """Per group: (gpu_block, cpu_block, sub_block) for every page, one at a time."""
    out: list[list[tuple[int, int, int]]] = []
    g_at = c_at = 0
    for size, index in zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True):
        skip = index % factor
        pages = []
        for k in range(size):
            sub = skip + k
            pages.append(
                (
                    int(gpu_spec.block_ids[g_at + k]),
                    int(cpu_ids[c_at + sub // factor]),
                    sub % factor,
                )
            )
        out.append(pages)
        g_at += size
        c_at += -(-(size + skip) // factor) if size else 0
    return out


def _page(cpu: torch.Tensor, block: int, sub: int, page: int) -> bytes:
    return cpu[block, sub * page : (sub + 1) * page].numpy().tobytes()


def _gpu_row(caches: CanonicalKVCaches, idx: int, block: int) -> bytes:
    return caches.tensors[idx].tensor[block].numpy().tobytes()


@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("poller_mode", ["thread", "adaptive", "spin"])
async def test_round_trip_is_byte_exact(factor: int, layout: str, poller_mode: str) -> None:
    groups, caches = _kv_caches(layout, [2, 1, 2])
    # Group 1 is empty in this request; group 2's first block is not aligned
    # to an offloaded block (index 4 with factor 3 -> skip one sub-block).
    gpu_spec = GPULoadStoreSpec([3, 9, 1, 7, 0, 12, 5, 18, 20], [5, 0, 4], [0, 2, 4])
    n_cpu = sum(-(-(s + i % factor) // factor) if s else 0 for s, i in [(5, 0), (4, 4)])
    cpu_ids = list(np.random.default_rng(factor).choice(30, size=n_cpu, replace=False))
    cpu_spec = CPULoadStoreSpec(cpu_ids)
    originals = [_gpu_row(caches, t, b) for t in range(len(caches.tensors)) for b in range(24)]

    async with make_cpu_gpu_handlers(
        caches, block_size_factor=factor, num_cpu_blocks=30, poller_mode=poller_mode
    ) as handlers:
        store = await handlers.gpu_to_cpu.transfer_async(1, (gpu_spec, cpu_spec))
        assert store.success and store.error is None
        assert store.transfer_type == ("GPU", "CPU")
        per_block = [caches.copied_bytes_per_block(g) for g in range(3)]
        assert store.transfer_size == 5 * per_block[0] + 4 * per_block[2]

        expected = _expected_cpu_pages(gpu_spec, cpu_ids, factor)
        written: set[tuple[int, int, int]] = set()
        for g, pages in enumerate(expected):
            for ref in caches.group_data_refs[g]:
                cpu = handlers.cpu_tensors[ref.tensor_idx]
                for gpu_block, cpu_block, sub in pages:
                    want = _gpu_row(caches, ref.tensor_idx, gpu_block)
                    assert _page(cpu, cpu_block, sub, ref.page_size_bytes) == want
                    written.add((ref.tensor_idx, cpu_block, sub))
        # Everything else in the pool, including the skipped sub-block, is untouched.
        for t, cpu in enumerate(handlers.cpu_tensors):
            for block in range(30):
                for sub in range(factor):
                    if (t, block, sub) not in written:
                        assert not any(_page(cpu, block, sub, caches.tensors[t].page_size_bytes))

        # Load back into other GPU blocks (same group shapes) and compare.
        load_ids = [2, 4, 6, 8, 10, 11, 13, 15, 17]
        load_spec = GPULoadStoreSpec(load_ids, [5, 0, 4], [0, 2, 4])
        load = await handlers.cpu_to_gpu.transfer_async(2, (cpu_spec, load_spec))
        assert load.success and load.transfer_type == ("CPU", "GPU")
        assert load.transfer_size == store.transfer_size
        for g, size_start in enumerate([(0, 5), (5, 0), (5, 4)]):
            start, size = size_start
            for ref in caches.group_data_refs[g]:
                for k in range(size):
                    src_block = int(gpu_spec.block_ids[start + k])
                    dst_block = load_ids[start + k]
                    assert (
                        _gpu_row(caches, ref.tensor_idx, dst_block)
                        == originals[ref.tensor_idx * 24 + src_block]
                    )
        # The raw engine tensors saw the load too (the canonical rows are views).
        if layout == "kv_first":
            assert torch.equal(groups[0][0][1, 2], groups[0][0][1, 3])
        else:
            assert torch.equal(groups[0][0][2], groups[0][0][3])


async def test_transfer_time_and_size_are_reported() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    async with make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=4) as handlers:
        result = await handlers.gpu_to_cpu.transfer_async(
            5, (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([3, 2]))
        )
    assert result.job_id == 5
    assert result.transfer_size == 2 * caches.tensors[0].page_size_bytes
    assert result.transfer_time is not None and result.transfer_time >= 0


@pytest.mark.both_loops
async def test_bounds_errors_raise_before_any_copy() -> None:
    _, caches = _kv_caches("kv_first", [2])
    async with make_cpu_gpu_handlers(caches, block_size_factor=2, num_cpu_blocks=4) as handlers:
        for cpu in handlers.cpu_tensors:
            cpu.fill_(7)
        before = [t.tensor.clone() for t in caches.tensors]
        bad = [
            # CPU block 4 does not exist (pool has 4 blocks)
            ((CPULoadStoreSpec([4]), GPULoadStoreSpec([0, 1], [2], [0])), "CPU block id 4"),
            # GPU block 24 does not exist
            ((CPULoadStoreSpec([0]), GPULoadStoreSpec([0, 24], [2], [0])), "GPU block id 24"),
            # partial first block needs two CPU blocks, one given
            ((CPULoadStoreSpec([0]), GPULoadStoreSpec([0, 1], [2], [1])), "need 2"),
            # wrong direction for this handler
            ((GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0])), "got a GPU -> CPU spec"),
            # two groups for caches with one
            ((CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1, 0], [0, 0])), "has 2 groups"),
        ]
        for spec, needle in bad:
            with pytest.raises(TransferSpecError, match=needle):
                handlers.cpu_to_gpu.transfer_async(1, spec)  # type: ignore[arg-type]
        assert handlers.cpu_to_gpu.in_flight == 0
        for t, old in zip(caches.tensors, before, strict=True):
            assert torch.equal(t.tensor, old)
        # The handler is still usable after rejecting bad input.
        ok = await handlers.cpu_to_gpu.transfer_async(
            1, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0, 1], [2], [0]))
        )
        assert ok.success
        assert bool((caches.tensors[0].tensor[0] == 7).all())


@pytest.mark.both_loops
async def test_completions_and_copies_follow_submission_order() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    async with make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=2) as handlers:
        store = handlers.gpu_to_cpu
        # Every job writes GPU block (job % 24) into the same CPU block: the last one must win.
        tasks = [
            store.transfer_async(
                job, (GPULoadStoreSpec([job % 24], [1], [0]), CPULoadStoreSpec([1]))
            )
            for job in range(60)
        ]
        results = [await task for task in tasks]
        assert all(r.success for r in results)
        finished = store.get_finished_nowait()
        assert [r.job_id for r in finished] == list(range(60))
        assert _page(handlers.cpu_tensors[0], 1, 0, caches.tensors[0].page_size_bytes) == _gpu_row(
            caches, 0, 59 % 24
        )


async def test_fault_injection_fails_the_transfer_and_frees_blocks() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    manager = CPUOffloadingManager(num_blocks=4)
    boom = RuntimeError("injected copy fault")
    calls: list[int] = []

    def failing_copy(copies: Sequence[HostCopy]) -> None:
        calls.append(len(copies))
        raise boom

    async with make_cpu_gpu_handlers(
        caches, block_size_factor=1, num_cpu_blocks=4, copy_fn=failing_copy
    ) as handlers:
        ctx = ReqContext()
        keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(3)]
        prepared = manager.prepare_store(keys, ctx)
        assert prepared is not None and prepared.keys_to_store == keys
        assert manager.num_free_blocks == 1
        gpu_spec = GPULoadStoreSpec([0, 1, 2], [3], [0])
        result = await handlers.gpu_to_cpu.transfer_async(11, (gpu_spec, prepared.store_spec))
        assert calls == [1]
        assert not result.success
        assert result.error is boom
        # What a scheduler does with a failed store: release the blocks.
        manager.complete_store(prepared.keys_to_store, success=result.success)
        assert manager.num_free_blocks == 4
        assert manager.lookup_prefix(keys, ctx) == 0
        # The pool was never written.
        assert not handlers.cpu_tensors[0].any()
        # And the same keys can be stored again.
        again = manager.prepare_store(keys, ctx)
        assert again is not None and again.keys_to_store == keys


async def test_aclose_waits_for_copies_in_flight() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    gate = threading.Event()
    started = threading.Event()

    def gated_copy(copies: Sequence[HostCopy]) -> None:
        started.set()
        gate.wait(timeout=10)
        apply_host_copies(copies)

    handlers = make_cpu_gpu_handlers(
        caches, block_size_factor=1, num_cpu_blocks=8, copy_fn=gated_copy
    )
    store = handlers.gpu_to_cpu
    tasks = [
        store.transfer_async(j, (GPULoadStoreSpec([j], [1], [0]), CPULoadStoreSpec([j])))
        for j in range(3)
    ]
    closing = asyncio.ensure_future(handlers.aclose())
    await asyncio.to_thread(started.wait, 10)
    await asyncio.sleep(0.01)
    assert not closing.done()
    assert store.in_flight == 3
    with pytest.raises(HandlerClosedError):
        store.transfer_async(9, (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0])))
    gate.set()
    await asyncio.wait_for(closing, timeout=10)
    assert all(t.done() and t.result().success for t in tasks)
    page = caches.tensors[0].page_size_bytes
    for j in range(3):
        assert _page(handlers.cpu_tensors[0], j, 0, page) == _gpu_row(caches, 0, j)
    assert store.in_flight == 0
    assert isinstance(store, HostOffloadingHandler)
    assert not store.dispatcher.running  # the worker thread was released


async def test_cancelled_wait_still_reports_the_copy() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    gate = threading.Event()

    def gated_copy(copies: Sequence[HostCopy]) -> None:
        gate.wait(timeout=10)
        apply_host_copies(copies)

    async with make_cpu_gpu_handlers(
        caches, block_size_factor=1, num_cpu_blocks=4, copy_fn=gated_copy
    ) as handlers:
        task = handlers.gpu_to_cpu.transfer_async(
            3, (GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([2]))
        )
        waiter = asyncio.ensure_future(_await(task))
        await asyncio.sleep(0)
        waiter.cancel()
        gate.set()
        result = await task
        assert result.success
        assert [r.job_id for r in handlers.gpu_to_cpu.get_finished_nowait()] == [3]
    page = caches.tensors[0].page_size_bytes
    assert _page(handlers.cpu_tensors[0], 2, 0, page) == _gpu_row(caches, 0, 5)


async def _await(task: object) -> object:
    return await task  # type: ignore[misc]


@pytest.mark.parametrize(
    ("src_rows", "dst_rows", "src_start", "dst_start"),
    [
        ([2, 3, 4], [5, 0, 1], 2, None),  # source is a run: one pass from a slice
        ([9, 0, 4], [2, 3, 4], None, 2),  # destination is a run: take into a slice
        ([2, 3, 4], [1, 2, 3], 2, 1),  # both runs: a slice assignment
        ([9, 0, 4], [5, 0, 3], None, None),  # scattered on both sides
    ],
)
def test_apply_host_copies_moves_whole_pages(
    src_rows: list[int], dst_rows: list[int], src_start: int | None, dst_start: int | None
) -> None:
    page = np.dtype((np.void, 4))
    src = np.arange(40, dtype=np.int8).reshape(10, 4)
    dst = np.zeros((6, 4), dtype=np.int8)
    copy = HostCopy(
        src.view(page).reshape(-1),
        dst.view(page).reshape(-1),
        np.array(src_rows),
        np.array(dst_rows),
        src_start,
        dst_start,
    )
    apply_host_copies([copy])
    for s_row, d_row in zip(src_rows, dst_rows, strict=True):
        assert dst[d_row].tolist() == src[s_row].tolist()
    untouched = sorted(set(range(6)) - set(dst_rows))
    assert not dst[untouched].any()
    assert copy.nbytes == 12


async def test_copy_threads_split_a_transfer_and_stay_exact() -> None:
    _, caches = _kv_caches("kv_first", [3, 2])
    spec_gpu = GPULoadStoreSpec([0, 5, 9, 11, 2, 3], [4, 2], [0, 0])
    spec_cpu = CPULoadStoreSpec([7, 1, 4, 0, 2, 3])
    for threads in (1, 3):
        handlers = make_cpu_gpu_handlers(  # split_min_bytes=0: split even this small transfer
            caches, block_size_factor=1, num_cpu_blocks=8, copy_threads=threads, split_min_bytes=0
        )
        async with handlers:
            result = await handlers.gpu_to_cpu.transfer_async(1, (spec_gpu, spec_cpu))
            assert result.success
            for g, pages in enumerate(_expected_cpu_pages(spec_gpu, spec_cpu.block_ids, 1)):
                for ref in caches.group_data_refs[g]:
                    for gpu_block, cpu_block, _ in pages:
                        got = _page(
                            handlers.cpu_tensors[ref.tensor_idx], cpu_block, 0, ref.page_size_bytes
                        )
                        assert got == _gpu_row(caches, ref.tensor_idx, gpu_block)
    with pytest.raises(ConfigError, match="copy_threads must be an int >= 1, got 0"):
        make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=8, copy_threads=0)


async def test_a_failing_share_fails_the_whole_transfer() -> None:
    _, caches = _kv_caches("kv_first", [2])
    calls = 0

    def second_share_fails(copies: Sequence[HostCopy]) -> None:
        nonlocal calls
        calls += 1
        if threading.current_thread().name.endswith("-h_0"):
            raise OSError("helper failed")
        apply_host_copies(copies)

    async with make_cpu_gpu_handlers(
        caches,
        block_size_factor=1,
        num_cpu_blocks=4,
        copy_threads=2,
        split_min_bytes=0,
        copy_fn=second_share_fails,
    ) as handlers:
        result = await handlers.gpu_to_cpu.transfer_async(
            1, (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0, 1]))
        )
    assert calls == 2
    assert not result.success and isinstance(result.error, OSError)


def test_pair_allocates_one_pool_per_tensor_and_validates() -> None:
    _, caches = _kv_caches("kv_first", [1, 1])
    handlers = make_cpu_gpu_handlers(caches, block_size_factor=4, num_cpu_blocks=5)
    assert isinstance(handlers, CpuGpuHandlers)
    assert len(handlers.cpu_tensors) == len(caches.tensors) == 4
    for cpu, kv in zip(handlers.cpu_tensors, caches.tensors, strict=True):
        assert cpu.shape == (5, kv.page_size_bytes * 4) and cpu.dtype == torch.int8
    with pytest.raises(LayoutError, match="CPU pool 0 rows must be"):
        HostOffloadingHandler(caches, handlers.cpu_tensors, block_size_factor=2, gpu_to_cpu=True)
    with pytest.raises(LayoutError, match="4 KV tensors need as many CPU pools, got 1"):
        HostOffloadingHandler(
            caches, handlers.cpu_tensors[:1], block_size_factor=4, gpu_to_cpu=True
        )


def test_cuda_caches_without_a_cuda_backend_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    _, caches = _kv_caches("blocks_first", [1])
    monkeypatch.setattr(CanonicalKVCaches, "is_cuda", property(lambda self: True))
    monkeypatch.setitem(sys.modules, "aiokvo.handlers.cuda.pair", None)  # import fails
    with pytest.raises(CudaUnavailableError, match="CUDA backend not available"):
        make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=2)


@pytest.mark.both_loops
async def test_cancel_storm_reports_each_result_once_and_leaks_nothing() -> None:
    pages = torch.arange(64 * 256, dtype=torch.int32).view(64, 256).view(torch.int8)
    caches = CanonicalKVCaches.from_engine([pages])
    manager = CPUOffloadingManager(num_blocks=1000)
    ctx = ReqContext()
    jobs = 1000
    keys = [make_offload_key(j.to_bytes(8, "big"), 0) for j in range(jobs)]
    async with make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=1000) as h:
        store = h.gpu_to_cpu
        waiters = []
        cpu_block = {}
        for job, key in enumerate(keys):
            out = manager.prepare_store([key], ctx)
            assert out is not None
            cpu_block[job] = int(out.store_spec.block_ids[0])  # type: ignore[attr-defined]
            task = store.transfer_async(
                job, (GPULoadStoreSpec([job % 64], [1], [0]), out.store_spec)
            )
            waiters.append(asyncio.ensure_future(_await(task)))
        for waiter in waiters[::2]:
            waiter.cancel()
        seen: list[int] = []
        async for result in store.get_finished():
            assert result.success
            seen.append(result.job_id)
            manager.complete_store([keys[result.job_id]], success=True)
            if len(seen) == jobs:
                break
        assert sorted(seen) == list(range(jobs)) and seen == sorted(seen)
        assert store.in_flight == 0 and store.get_finished_nowait() == []
        done = await asyncio.gather(*waiters[1::2])
        assert [r.job_id for r in done] == list(range(1, jobs, 2))  # type: ignore[attr-defined]
        assert all(w.cancelled() for w in waiters[::2])
        for job in (0, 1, 499, 999):  # the copies themselves all ran
            row = h.cpu_tensors[0][cpu_block[job]]
            assert torch.equal(row, caches.tensors[0].tensor[job % 64])
    # Nothing is left pinned or half-written: every block is ready and evictable.
    assert manager.lookup_prefix(keys, ctx) == jobs
    fresh = [make_offload_key(b"new" + j.to_bytes(8, "big"), 0) for j in range(jobs)]
    out = manager.prepare_store(fresh, ctx)
    assert out is not None and len(out.evicted_keys) == jobs


async def test_many_tiny_transfers_pipelined_are_byte_exact_and_fifo() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    page = caches.tensors[0].page_size_bytes
    async with make_cpu_gpu_handlers(caches, block_size_factor=1, num_cpu_blocks=16) as handlers:
        store = handlers.gpu_to_cpu
        tasks = [
            store.transfer_async(
                job,
                (GPULoadStoreSpec([job % NUM_GPU_BLOCKS], [1], [0]), CPULoadStoreSpec([job % 16])),
            )
            for job in range(500)
        ]
        results = [await task for task in tasks]
    assert all(r.success and r.transfer_size == page for r in results)
    assert [r.job_id for r in results] == list(range(500))
    for cpu_block in range(16):  # the last job that wrote each CPU block won
        last = max(j for j in range(500) if j % 16 == cpu_block)
        assert _page(handlers.cpu_tensors[0], cpu_block, 0, page) == _gpu_row(
            caches, 0, last % NUM_GPU_BLOCKS
        )


def test_page_views_are_int64_words_only_where_pages_are_aligned_words() -> None:
    pool = torch.arange(6 * 32, dtype=torch.int8).reshape(6, 32)
    words = page_elements(pool, 1, 32)
    assert words.dtype == np.int64 and words.shape == (6, 4)
    assert page_elements(pool, 2, 16).shape == (12, 2)  # sub-blocks of a row
    flat = torch.zeros(6 * 32 + 1, dtype=torch.int8)
    fallbacks = {
        "12-byte pages": (torch.zeros(6, 12, dtype=torch.int8), 12),
        "pointer off by one byte": (flat[1:].view(6, 32), 32),
        "36-byte row stride": (torch.zeros(6, 36, dtype=torch.int8), 32),
    }
    for name, (tensor, nbytes) in fallbacks.items():
        view = page_elements(tensor, 1, nbytes)
        assert view.dtype == np.dtype((np.void, nbytes)) and view.shape == (6,), name
    # Both kinds of view move the same bytes.
    for as_words in (True, False):
        dst = torch.zeros(4, 32, dtype=torch.int8)
        pages = page_words if as_words else page_voids
        src_pages, dst_pages = pages(pool, 1, 32), pages(dst, 1, 32)
        assert src_pages is not None and dst_pages is not None
        copy = HostCopy(
            src_pages,
            dst_pages,
            np.array([5, 0, 3]),
            np.array([2, 0, 1]),
            None,
            None,
        )
        assert copy.nbytes == 3 * 32
        apply_host_copies([copy])
        assert dst[[2, 0, 1]].tolist() == pool[[5, 0, 3]].tolist() and not dst[3].any()


class CopyRecorder:
    """A ``copy_fn`` that does the copy and records the page views and the thread."""

    def __init__(self) -> None:
        self.dtypes: list[np.dtype[Any]] = []
        self.threads: list[str] = []

    def __call__(self, copies: Sequence[HostCopy]) -> None:
        self.threads.append(threading.current_thread().name)
        self.dtypes.extend(view.dtype for copy in copies for view in (copy.src, copy.dst))
        apply_host_copies(copies)


@pytest.mark.parametrize("page_elems", [3, 24])  # 12-byte pages (np.void) and 96-byte (int64)
async def test_split_round_trip_is_byte_exact_for_both_page_views(page_elems: int) -> None:
    _, caches = _kv_caches("kv_first", [3, 2], page_elems=page_elems)
    gpu_spec = GPULoadStoreSpec([0, 5, 9, 11, 2, 3], [4, 2], [0, 0])
    cpu_spec = CPULoadStoreSpec([7, 1, 4, 0, 2, 3])
    originals = {(t, b): _gpu_row(caches, t, b) for t in range(10) for b in range(NUM_GPU_BLOCKS)}
    recorder = CopyRecorder()
    async with make_cpu_gpu_handlers(
        caches,
        block_size_factor=1,
        num_cpu_blocks=8,
        copy_threads=2,
        split_min_bytes=0,
        copy_fn=recorder,
    ) as handlers:
        assert (await handlers.gpu_to_cpu.transfer_async(1, (gpu_spec, cpu_spec))).success
        load_spec = GPULoadStoreSpec([12, 13, 14, 15, 16, 17], [4, 2], [0, 0])
        assert (await handlers.cpu_to_gpu.transfer_async(2, (cpu_spec, load_spec))).success
    want = np.int64 if page_elems == 24 else np.dtype((np.void, 4 * page_elems))
    assert len(recorder.dtypes) == 40 and all(dtype == want for dtype in recorder.dtypes)
    moved = [([0, 5, 9, 11], [12, 13, 14, 15]), ([2, 3], [16, 17])]  # per group: GPU -> GPU
    for g, (sources, targets) in enumerate(moved):
        for ref in caches.group_data_refs[g]:
            for src, dst in zip(sources, targets, strict=True):
                assert _gpu_row(caches, ref.tensor_idx, dst) == originals[ref.tensor_idx, src]


async def test_only_transfers_of_split_min_bytes_or_more_are_split() -> None:
    _, caches = _kv_caches("kv_first", [2])
    spec = (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0, 1]))
    size = 2 * caches.copied_bytes_per_block(0)
    for threshold, want in (
        (SPLIT_MIN_BYTES, ["aiokvo-host-g2c"]),
        (size + 1, ["aiokvo-host-g2c"]),
        (size, ["aiokvo-host-g2c", "aiokvo-host-g2c-h_0"]),
    ):
        recorder = CopyRecorder()
        async with make_cpu_gpu_handlers(
            caches,
            block_size_factor=1,
            num_cpu_blocks=4,
            copy_threads=2,
            split_min_bytes=threshold,
            copy_fn=recorder,
        ) as handlers:
            result = await handlers.gpu_to_cpu.transfer_async(1, spec)
        assert result.success and result.transfer_size == size
        assert sorted(recorder.threads) == want, threshold
    assert size < SPLIT_MIN_BYTES


async def test_split_transfers_complete_whole_and_in_order() -> None:
    _, caches = _kv_caches("blocks_first", [3])
    gate = threading.Event()  # holds the helper's share of the first transfer
    dispatch_share_done = threading.Event()

    def gated(copies: Sequence[HostCopy]) -> None:
        if threading.current_thread().name.endswith("-h_0"):
            gate.wait()
            apply_host_copies(copies)
        else:
            apply_host_copies(copies)
            dispatch_share_done.set()

    page = caches.tensors[0].page_size_bytes
    async with make_cpu_gpu_handlers(
        caches,
        block_size_factor=1,
        num_cpu_blocks=2,
        copy_threads=2,
        split_min_bytes=0,
        copy_fn=gated,
    ) as handlers:
        store = handlers.gpu_to_cpu
        # Every job writes GPU block job into CPU block 1 of all three tensors: the last wins.
        tasks = [
            asyncio.ensure_future(
                store.transfer_async(
                    job, (GPULoadStoreSpec([job], [1], [0]), CPULoadStoreSpec([1]))
                )
            )
            for job in range(20)
        ]
        await asyncio.to_thread(dispatch_share_done.wait)
        await asyncio.sleep(0)
        assert not any(task.done() for task in tasks)  # job 0 waits for its helper share
        assert store.get_finished_nowait() == []
        gate.set()
        results = [await task for task in tasks]
    assert all(r.success for r in results)
    assert [r.job_id for r in results] == list(range(20))
    for t in range(3):
        assert _page(handlers.cpu_tensors[t], 1, 0, page) == _gpu_row(caches, t, 19)


async def test_an_unaligned_side_makes_both_sides_fall_back_to_void_pages() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    gpu = caches.tensors[0].tensor
    page = caches.tensors[0].page_size_bytes
    flat = torch.zeros(4 * page + 1, dtype=torch.int8)
    pool = flat[1:].view(4, page)  # contiguous, but starts one byte past a word
    recorder = CopyRecorder()
    store = HostOffloadingHandler(  # the split path, which prefers words
        caches,
        [pool],
        block_size_factor=1,
        gpu_to_cpu=True,
        copy_threads=2,
        split_min_bytes=0,
        copy_fn=recorder,
    )
    async with store:
        result = await store.transfer_async(
            1, (GPULoadStoreSpec([7, 2], [2], [0]), CPULoadStoreSpec([3, 0]))
        )
    assert result.success
    assert recorder.dtypes == [np.dtype((np.void, page))] * 2
    assert pool[3].numpy().tobytes() == gpu[7].numpy().tobytes()
    assert pool[0].numpy().tobytes() == gpu[2].numpy().tobytes()
    assert not pool[1:3].any()


@pytest.mark.parametrize("copy_threads", [1, 2])
async def test_unsplit_transfers_use_void_pages_and_split_ones_int64_words(
    copy_threads: int,
) -> None:
    _, caches = _kv_caches("blocks_first", [2])
    spec = (GPULoadStoreSpec([4, 9], [2], [0]), CPULoadStoreSpec([1, 0]))
    page = caches.tensors[0].page_size_bytes
    void = np.dtype((np.void, page))
    for split_min_bytes, words in ((SPLIT_MIN_BYTES, False), (0, copy_threads == 2)):
        recorder = CopyRecorder()
        async with make_cpu_gpu_handlers(
            caches,
            block_size_factor=1,
            num_cpu_blocks=2,
            copy_threads=copy_threads,
            split_min_bytes=split_min_bytes,
            copy_fn=recorder,
        ) as handlers:
            assert (await handlers.gpu_to_cpu.transfer_async(1, spec)).success
        assert set(recorder.dtypes) == {np.dtype(np.int64) if words else void}
        for t in range(2):
            assert _page(handlers.cpu_tensors[t], 1, 0, page) == _gpu_row(caches, t, 4)
            assert _page(handlers.cpu_tensors[t], 0, 0, page) == _gpu_row(caches, t, 9)


@pytest.mark.parametrize("factor", [1, 2])
def test_kv_caches_on_a_device_numpy_cannot_reach_are_refused_when_built(factor: int) -> None:
    layer = torch.empty((4, 2, 8), dtype=torch.bfloat16, device="meta")
    caches = CanonicalKVCaches.from_engine([layer])
    with pytest.raises(LayoutError, match="KV caches are on meta"):
        make_cpu_gpu_handlers(caches, block_size_factor=factor, num_cpu_blocks=2)
    pool = [torch.zeros((2, caches.tensors[0].page_size_bytes * factor), dtype=torch.int8)]
    for gpu_to_cpu in (True, False):
        with pytest.raises(LayoutError, match="KV caches are on meta"):
            HostOffloadingHandler(caches, pool, block_size_factor=factor, gpu_to_cpu=gpu_to_cpu)


def test_a_pool_on_another_device_or_with_overlapping_rows_is_refused() -> None:
    _, caches = _kv_caches("blocks_first", [1])
    page = caches.tensors[0].page_size_bytes
    meta_pool = [torch.empty((4, page), dtype=torch.int8, device="meta")]
    with pytest.raises(LayoutError, match="CPU pool 0 must be a CPU tensor, got one on meta"):
        HostOffloadingHandler(caches, meta_pool, block_size_factor=1, gpu_to_cpu=True)
    flat = torch.zeros(4 * page, dtype=torch.int8)
    overlapping = [flat.as_strided((4, page), (page // 2, 1))]
    with pytest.raises(LayoutError, match="rows overlap"):
        HostOffloadingHandler(caches, overlapping, block_size_factor=1, gpu_to_cpu=True)
    columns = [torch.zeros((page, 4), dtype=torch.int8).t()]
    with pytest.raises(LayoutError, match="byte-contiguous rows"):
        HostOffloadingHandler(caches, columns, block_size_factor=1, gpu_to_cpu=True)


def test_split_by_part_groups_a_copys_pages_by_their_place_in_a_row() -> None:
    src, dst = np.array([0, 1, 2, 3, 4]), np.array([7, 2, 5, 4, 9])  # dst: 2 pages per row
    parts = [(s, sr.tolist(), d, dr.tolist()) for s, sr, d, dr in split_by_part(src, 0, dst, 2)]
    assert parts == [(-1, [1, 3], 0, [1, 2]), (-1, [0, 2, 4], 1, [3, 2, 4])]
    both = split_by_part(np.array([5, 0]), 3, np.array([1, 4]), 2)
    assert [(s, sr.tolist(), d, dr.tolist()) for s, sr, d, dr in both] == [
        (0, [0], 0, [2]),
        (2, [1], 1, [0]),
    ]
