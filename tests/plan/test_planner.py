"""Copy plans: pointer math against a per-page reference, and every bounds check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokvo.errors import TransferSpecError
from aiokvo.layout import CanonicalKVCacheRef
from aiokvo.plan import (
    PointerPlan,
    RowSpace,
    TensorLike,
    TransferPlan,
    TransferPlanner,
    compute_sub_block_ptrs,
)
from aiokvo.plan.rows import check_ptrs_inside
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec


def plan_transfer(
    spec: TransferSpec,
    refs: list[list[CanonicalKVCacheRef]],
    src: list[TensorLike],
    dst: list[TensorLike],
    factor: int,
) -> TransferPlan:
    """One transfer through a fresh planner: the reference a reused planner must match."""
    return TransferPlanner(refs, src, dst, factor).plan(spec)


def plan_copy_ptrs(
    spec: TransferSpec,
    refs: list[list[CanonicalKVCacheRef]],
    src: list[TensorLike],
    dst: list[TensorLike],
    factor: int,
) -> PointerPlan:
    return plan_transfer(spec, refs, src, dst, factor).pointers()

# -- compute_sub_block_ptrs -----------------------------------------------------------


def test_sub_block_ptrs_skip_partial_first_block() -> None:
    # 3 blocks of 2 sub-blocks of 8 bytes; skip the first sub-block, take 4.
    tensor = torch.zeros((5, 16), dtype=torch.int8)
    base = tensor.data_ptr()
    out = np.empty(4, dtype=np.int64)
    compute_sub_block_ptrs(np.array([0, 1, 2]), 2, out, tensor, skip_count=1)
    assert out.tolist() == [base + 8, base + 16, base + 24, base + 32]


def test_sub_block_ptrs_factor_one_uses_row_stride() -> None:
    storage = torch.zeros((6, 40), dtype=torch.int8)
    tensor = storage[:, :24]  # rows of 24 bytes, 40 bytes apart
    out = np.empty(3, dtype=np.int64)
    compute_sub_block_ptrs(np.array([4, 0, 5]), 1, out, tensor)
    base = storage.data_ptr()
    assert out.tolist() == [base + 160, base, base + 200]


def test_sub_block_ptrs_factor_three_non_contiguous_rows() -> None:
    storage = torch.zeros((4, 40), dtype=torch.int8)
    tensor = storage[:, :30]  # 3 sub-blocks of 10 bytes per row, rows 40 apart
    out = np.empty(5, dtype=np.int64)
    compute_sub_block_ptrs(np.array([3, 1]), 3, out, tensor, skip_count=1)
    base = storage.data_ptr()
    assert out.tolist() == [base + 130, base + 140, base + 40, base + 50, base + 60]


@pytest.mark.parametrize(
    ("ids", "factor", "n_out", "skip", "needle"),
    [
        ([0, 1], 2, 2, 2, "skip_count must be in 0..1, got 2"),
        ([0, 1], 2, 4, 1, "4 sub-blocks requested"),
        ([0, 9], 1, 2, 0, "block id 9"),
        ([0, -1], 1, 2, 0, "block id -1"),
        ([0], 0, 1, 0, "block_size_factor must be an int >= 1, got 0"),
        ([0], 3, 1, 0, "not divisible by block_size_factor 3"),
    ],
)
def test_sub_block_ptrs_rejects_bad_input(
    ids: list[int], factor: int, n_out: int, skip: int, needle: str
) -> None:
    tensor = torch.zeros((4, 16), dtype=torch.int8)
    out = np.full(n_out, -7, dtype=np.int64)
    with pytest.raises(TransferSpecError, match=needle):
        compute_sub_block_ptrs(np.array(ids), factor, out, tensor, skip_count=skip)
    assert (out == -7).all()  # nothing written


def test_sub_block_ptrs_rejects_wrong_output_dtype() -> None:
    tensor = torch.zeros((4, 16), dtype=torch.int8)
    with pytest.raises(TransferSpecError, match="int64"):
        compute_sub_block_ptrs(np.array([0]), 1, np.empty(1, dtype=np.int32), tensor)


# -- plan_transfer against a per-page reference --------------------------------------


def _reference_ptrs(
    gpu: GPULoadStoreSpec,
    cpu: CPULoadStoreSpec,
    refs: list[list[CanonicalKVCacheRef]],
    gpu_spaces: list[RowSpace],
    cpu_spaces: list[RowSpace],
    factor: int,
) -> set[tuple[int, int, int]]:
    """(gpu_ptr, cpu_ptr, size) of every page copy, one page at a time."""
    copies = set()
    g_at = c_at = 0
    for g, size in enumerate(gpu.group_sizes):
        skip = gpu.block_indices[g] % factor
        for k in range(size):
            gpu_block = int(gpu.block_ids[g_at + k])
            sub = skip + k
            cpu_block = int(cpu.block_ids[c_at + sub // factor])
            for ref in refs[g]:
                gs, cs = gpu_spaces[ref.tensor_idx], cpu_spaces[ref.tensor_idx]
                gptr = gs.base_ptr + gpu_block * gs.row_stride
                cptr = (
                    cs.base_ptr
                    + cpu_block * cs.row_stride
                    + (sub % factor) * (cs.row_bytes // factor)
                )
                copies.add((gptr, cptr, ref.page_size_bytes))
        g_at += size
        c_at += -(-(size + skip) // factor) if size else 0
    return copies


def _random_case(
    rng: np.random.Generator, factor: int
) -> tuple[
    GPULoadStoreSpec,
    CPULoadStoreSpec,
    list[list[CanonicalKVCacheRef]],
    list[RowSpace],
    list[RowSpace],
]:
    num_tensors = 4
    pages = [16 * int(rng.integers(1, 5)) for _ in range(num_tensors)]
    gpu_spaces = [RowSpace(0x1000_0000 * (i + 1), 50, p + 16, p) for i, p in enumerate(pages)]
    cpu_spaces = [
        RowSpace(0x9000_0000 * (i + 1), 40, p * factor, p * factor) for i, p in enumerate(pages)
    ]
    refs = [
        [CanonicalKVCacheRef(0, pages[0]), CanonicalKVCacheRef(1, pages[1] - 8)],
        [],  # a group with no layers
        [CanonicalKVCacheRef(2, pages[2]), CanonicalKVCacheRef(3, pages[3])],
    ]
    sizes = [int(rng.integers(0, 7)) for _ in refs]
    indices = [int(rng.integers(0, 20)) for _ in refs]
    gpu_ids = rng.choice(50, size=sum(sizes), replace=False)
    gpu = GPULoadStoreSpec(gpu_ids, sizes, indices)
    n_cpu = sum(
        -(-(s + i % factor) // factor) if s else 0 for s, i in zip(sizes, indices, strict=True)
    )
    cpu = CPULoadStoreSpec(rng.choice(40, size=n_cpu, replace=False))
    return gpu, cpu, refs, gpu_spaces, cpu_spaces


@pytest.mark.parametrize("factor", [1, 2, 3, 4])
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_pointer_plan_matches_per_page_reference(factor: int, gpu_to_cpu: bool) -> None:
    rng = np.random.default_rng(factor * 10 + gpu_to_cpu)
    for _ in range(25):
        gpu, cpu, refs, gpu_spaces, cpu_spaces = _random_case(rng, factor)
        want = _reference_ptrs(gpu, cpu, refs, gpu_spaces, cpu_spaces, factor)
        if gpu_to_cpu:
            plan = plan_copy_ptrs((gpu, cpu), refs, gpu_spaces, cpu_spaces, factor)
            got = set(
                zip(
                    plan.src_ptrs.tolist(), plan.dst_ptrs.tolist(), plan.sizes.tolist(), strict=True
                )
            )
        else:
            plan = plan_copy_ptrs((cpu, gpu), refs, cpu_spaces, gpu_spaces, factor)
            got = set(
                zip(
                    plan.dst_ptrs.tolist(), plan.src_ptrs.tolist(), plan.sizes.tolist(), strict=True
                )
            )
        assert got == want
        assert len(plan) == len(want)
        assert plan.total_bytes == sum(size for _, _, size in want)
        assert plan.src_ptrs.dtype == plan.dst_ptrs.dtype == plan.sizes.dtype == np.int64


def test_row_copies_merge_groups_per_tensor() -> None:
    refs = [[CanonicalKVCacheRef(0, 8)], [CanonicalKVCacheRef(0, 8)], []]
    gpu = GPULoadStoreSpec([3, 4, 7], [2, 1, 0], [0, 5, 0])
    cpu = CPULoadStoreSpec([9, 2, 0])
    spaces = [torch.zeros((10, 8), dtype=torch.int8)]
    plan = plan_transfer((gpu, cpu), refs, spaces, spaces, 1)
    (copy,) = plan.row_copies()
    assert copy.tensor_idx == 0 and copy.nbytes == 8
    assert copy.src_rows.tolist() == [3, 4, 7]
    assert copy.dst_rows.tolist() == [9, 2, 0]
    assert plan.num_copies == 3 and plan.total_bytes == 24
    assert (plan.src_factor, plan.dst_factor) == (1, 1)


def test_partial_first_block_sub_rows() -> None:
    # factor 3, group starts at logical block 4 -> skip 1 sub-row of the first CPU block
    refs = [[CanonicalKVCacheRef(0, 8)]]
    gpu = GPULoadStoreSpec([10, 11, 12, 13], [4], [4])
    cpu = CPULoadStoreSpec([5, 2])
    gpu_t = torch.zeros((20, 8), dtype=torch.int8)
    cpu_t = torch.zeros((8, 24), dtype=torch.int8)
    plan = plan_transfer((cpu, gpu), refs, [cpu_t], [gpu_t], 3)
    (copy,) = plan.row_copies()
    assert copy.src_rows.tolist() == [16, 17, 6, 7]  # 5*3+1, 5*3+2, 2*3+0, 2*3+1
    assert copy.dst_rows.tolist() == [10, 11, 12, 13]
    assert (plan.src_factor, plan.dst_factor) == (3, 1)


# -- validation ----------------------------------------------------------------------


def _tensors(
    gpu_rows: int = 10, cpu_rows: int = 6, page: int = 16, factor: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[CanonicalKVCacheRef]]]:
    gpu = [torch.zeros((gpu_rows, page), dtype=torch.int8) for _ in range(2)]
    cpu = [torch.zeros((cpu_rows, page * factor), dtype=torch.int8) for _ in range(2)]
    refs = [[CanonicalKVCacheRef(0, page)], [CanonicalKVCacheRef(1, page)]]
    return gpu, cpu, refs


@pytest.mark.parametrize(
    ("gpu_spec", "cpu_spec", "factor", "needle"),
    [
        (GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0, 1]), 1, "has 1 groups"),
        (GPULoadStoreSpec([1, 2], [1, 1], [0, 0]), CPULoadStoreSpec([0]), 1, "need 2"),
        (GPULoadStoreSpec([1, 2], [1, 1], [0, 0]), CPULoadStoreSpec([0, 1, 2]), 1, "need 2"),
        # factor 2, group 0 starts mid-block: 2 pages + skip 1 -> 2 CPU blocks, not 1
        (GPULoadStoreSpec([1, 2], [2, 0], [1, 0]), CPULoadStoreSpec([0]), 2, "need 2"),
        (GPULoadStoreSpec([1, 10], [1, 1], [0, 0]), CPULoadStoreSpec([0, 1]), 1, "GPU block id 10"),
        (GPULoadStoreSpec([1, 2], [1, 1], [0, 0]), CPULoadStoreSpec([0, 6]), 1, "CPU block id 6"),
        (GPULoadStoreSpec([1], [1, 0], [0, 0]), CPULoadStoreSpec([0]), 0, "factor must be an int"),
    ],
)
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_plan_rejects_inconsistent_specs(
    gpu_spec: GPULoadStoreSpec,
    cpu_spec: CPULoadStoreSpec,
    factor: int,
    needle: str,
    gpu_to_cpu: bool,
) -> None:
    gpu, cpu, refs = _tensors(factor=max(factor, 1))
    with pytest.raises(TransferSpecError, match=needle):
        if gpu_to_cpu:
            plan_transfer((gpu_spec, cpu_spec), refs, gpu, cpu, factor)
        else:
            plan_transfer((cpu_spec, gpu_spec), refs, cpu, gpu, factor)


def test_plan_rejects_routes_without_exactly_one_gpu_side() -> None:
    gpu, cpu, refs = _tensors()
    spec = GPULoadStoreSpec([1], [1, 0], [0, 0])
    with pytest.raises(TransferSpecError, match="exactly one side"):
        plan_transfer((spec, spec), refs, gpu, gpu, 1)
    with pytest.raises(TransferSpecError, match="exactly one side"):
        plan_transfer((CPULoadStoreSpec([0]), CPULoadStoreSpec([1])), refs, cpu, cpu, 1)
    with pytest.raises(TransferSpecError, match="pair"):
        plan_transfer((spec,), refs, gpu, cpu, 1)  # type: ignore[arg-type]


def test_plan_rejects_pages_larger_than_rows() -> None:
    gpu, cpu, _ = _tensors(page=16)
    refs = [[CanonicalKVCacheRef(0, 32)], []]
    with pytest.raises(TransferSpecError, match="copies 32 bytes per page of tensor 0"):
        plan_transfer(
            (GPULoadStoreSpec([0], [1, 0], [0, 0]), CPULoadStoreSpec([0])), refs, gpu, cpu, 1
        )


def test_plan_rejects_unknown_tensor_index_and_count_mismatch() -> None:
    gpu, cpu, _ = _tensors()
    spec = (GPULoadStoreSpec([0], [1, 0], [0, 0]), CPULoadStoreSpec([0]))
    with pytest.raises(TransferSpecError, match="refers to tensor 5"):
        plan_transfer(spec, [[CanonicalKVCacheRef(5, 16)], []], gpu, cpu, 1)
    with pytest.raises(TransferSpecError, match="2 source tensors but 1 destination"):
        plan_transfer(spec, [[], []], gpu, cpu[:1], 1)


def test_plan_rejects_offload_rows_not_divisible_by_factor() -> None:
    gpu = [torch.zeros((4, 16), dtype=torch.int8)]
    cpu = [torch.zeros((4, 40), dtype=torch.int8)]
    spec = (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
    with pytest.raises(TransferSpecError, match="not divisible by block_size_factor 3"):
        plan_transfer(spec, [[CanonicalKVCacheRef(0, 8)]], gpu, cpu, 3)


def test_empty_transfer_plans_nothing() -> None:
    gpu, cpu, refs = _tensors()
    plan = plan_copy_ptrs(
        (GPULoadStoreSpec([], [0, 0], [3, 0]), CPULoadStoreSpec([])), refs, gpu, cpu, 1
    )
    assert len(plan) == 0 and plan.total_bytes == 0


# -- RowSpace ------------------------------------------------------------------------


def test_row_space_of_tensor_checks_layout() -> None:
    t = torch.zeros((4, 32), dtype=torch.int8)
    space = RowSpace.of(t[:, :16])
    assert (space.num_rows, space.row_stride, space.row_bytes) == (4, 32, 16)
    assert space.end_ptr == t.data_ptr() + 3 * 32 + 16
    with pytest.raises(TransferSpecError, match="2-D int8"):
        RowSpace.of(torch.zeros((4, 8), dtype=torch.float32))
    with pytest.raises(TransferSpecError, match="byte-contiguous"):
        RowSpace.of(t.t())
    with pytest.raises(TransferSpecError, match="smaller than the row width"):
        RowSpace(0, 4, 8, 16)


def test_last_row_pointers_end_exactly_at_the_tensor_end() -> None:
    gpu = [RowSpace(0x1000, 4, 16, 16)]
    cpu = [RowSpace(0x9000, 4, 32, 32)]
    plan = plan_transfer(
        (GPULoadStoreSpec([3], [1], [1]), CPULoadStoreSpec([3])),
        [[CanonicalKVCacheRef(0, 16)]],
        gpu,
        cpu,
        2,
    )
    ptrs = plan.pointers()
    assert ptrs.src_ptrs.tolist() == [0x1000 + 48]
    assert ptrs.dst_ptrs.tolist() == [0x9000 + 3 * 32 + 16]
    assert ptrs.dst_ptrs[0] + 16 == cpu[0].end_ptr


def test_pointer_guard_rejects_copies_leaving_the_tensor() -> None:
    space = RowSpace(0x1000, 4, 16, 16)
    check_ptrs_inside(np.array([0x1000, 0x1030]), 16, space, "source", 0)
    with pytest.raises(TransferSpecError, match="leaves the tensor"):
        check_ptrs_inside(np.array([0x1031]), 16, space, "source", 0)
    with pytest.raises(TransferSpecError, match="leaves the tensor"):
        check_ptrs_inside(np.array([0xFFF]), 1, space, "destination", 0)


# -- TransferPlanner -----------------------------------------------------------------


def _same_plan(a: object, b: object) -> None:
    assert isinstance(a, TransferPlan) and isinstance(b, TransferPlan)
    pa, pb = a.pointers(), b.pointers()
    assert pa.src_ptrs.tolist() == pb.src_ptrs.tolist()
    assert pa.dst_ptrs.tolist() == pb.dst_ptrs.tolist()
    assert pa.sizes.tolist() == pb.sizes.tolist()
    assert (a.total_bytes, a.src_factor, a.dst_factor) == (
        b.total_bytes,
        b.src_factor,
        b.dst_factor,
    )
    assert [(c.tensor_idx, c.nbytes) for c in a.row_copies()] == [
        (c.tensor_idx, c.nbytes) for c in b.row_copies()
    ]


@pytest.mark.parametrize("factor", [1, 3])
def test_a_reused_planner_plans_what_a_fresh_one_plans(factor: int) -> None:
    rng = np.random.default_rng(factor)
    gpu_t, cpu_t, _ = _tensors(gpu_rows=50, cpu_rows=40, factor=factor)
    one_group = [[CanonicalKVCacheRef(0, 16), CanonicalKVCacheRef(1, 8)]]
    store = TransferPlanner(one_group, gpu_t, cpu_t, factor)
    load = TransferPlanner(one_group, cpu_t, gpu_t, factor)
    for _ in range(20):  # single group: the planner's fast path when factor is 1
        n = int(rng.integers(0, 6))
        index = int(rng.integers(0, 9))
        gpu = GPULoadStoreSpec(rng.choice(50, size=n, replace=False), [n], [index])
        n_cpu = -(-(n + index % factor) // factor) if n else 0
        cpu = CPULoadStoreSpec(rng.choice(40, size=n_cpu, replace=False))
        planned = store.plan((gpu, cpu))
        _same_plan(planned, plan_transfer((gpu, cpu), one_group, gpu_t, cpu_t, factor))
        spaces = [RowSpace.of(t) for t in gpu_t], [RowSpace.of(t) for t in cpu_t]
        ptrs = planned.pointers()  # and against the page-by-page reference
        got = set(
            zip(ptrs.src_ptrs.tolist(), ptrs.dst_ptrs.tolist(), ptrs.sizes.tolist(), strict=True)
        )
        assert got == _reference_ptrs(gpu, cpu, one_group, *spaces, factor)
        _same_plan(
            load.plan((cpu, gpu)), plan_transfer((cpu, gpu), one_group, cpu_t, gpu_t, factor)
        )
    for _ in range(20):  # several groups, one of them empty
        gpu, cpu, refs, gpu_spaces, cpu_spaces = _random_case(rng, factor)
        planner = TransferPlanner(refs, gpu_spaces, cpu_spaces, factor)
        want = plan_transfer((gpu, cpu), refs, gpu_spaces, cpu_spaces, factor)
        _same_plan(planner.plan((gpu, cpu)), want)


@pytest.mark.parametrize(
    ("gpu_spec", "cpu_spec", "needle"),
    [
        (GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0]), "need 2"),
        (GPULoadStoreSpec([1, 10], [2], [0]), CPULoadStoreSpec([0, 1]), "GPU block id 10"),
        (GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0, 6]), "CPU block id 6"),
        (GPULoadStoreSpec([1], [1, 0], [0, 0]), CPULoadStoreSpec([0]), "has 2 groups"),
    ],
)
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_a_reused_planner_raises_what_a_fresh_one_raises(
    gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, needle: str, gpu_to_cpu: bool
) -> None:
    gpu_t = [torch.zeros((10, 16), dtype=torch.int8)]
    cpu_t = [torch.zeros((6, 16), dtype=torch.int8)]
    refs = [[CanonicalKVCacheRef(0, 16)]]
    spec, src, dst = (
        ((gpu_spec, cpu_spec), gpu_t, cpu_t) if gpu_to_cpu else ((cpu_spec, gpu_spec), cpu_t, gpu_t)
    )
    planner = TransferPlanner(refs, src, dst, 1)
    for _ in range(2):  # the second time with the spec types already known
        with pytest.raises(TransferSpecError, match=needle) as got:
            planner.plan(spec)
        with pytest.raises(TransferSpecError) as want:
            plan_transfer(spec, refs, src, dst, 1)
        assert str(got.value) == str(want.value)


def test_planner_with_bad_refs_raises_on_each_plan() -> None:
    gpu, cpu, _ = _tensors(page=16)
    refs = [[CanonicalKVCacheRef(0, 32)], []]
    planner = TransferPlanner(refs, gpu, cpu, 1)  # checked per direction, on first use
    spec = (GPULoadStoreSpec([0], [1, 0], [0, 0]), CPULoadStoreSpec([0]))
    for _ in range(2):
        with pytest.raises(TransferSpecError, match="copies 32 bytes per page of tensor 0"):
            planner.plan(spec)
    with pytest.raises(TransferSpecError, match="exactly one side"):
        planner.plan((CPULoadStoreSpec([0]), CPULoadStoreSpec([1])))
    with pytest.raises(TransferSpecError, match="pair"):
        planner.plan((spec[0],))  # type: ignore[arg-type]
