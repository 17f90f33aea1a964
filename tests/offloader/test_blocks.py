"""GpuBlocks: which GPU blocks belong to which key, checked before anything happens.

The specs it builds are checked against what the planner (the handlers'
validation) accepts and against the GPU blocks each key must map to.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokvo.errors import TransferSpecError
from aiokvo.layout import CanonicalKVCaches
from aiokvo.offloader.blocks import GpuGeometry
from aiokvo.plan import TransferPlanner
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec


def geometry(groups: int = 1, factor: int = 1, rows: int = 32) -> GpuGeometry:
    layers = [[torch.zeros(rows, 8, dtype=torch.int8)] for _ in range(groups)]
    return GpuGeometry(CanonicalKVCaches.from_engine(layers), factor)


def ids(spec: GPULoadStoreSpec) -> list[int]:
    return [int(i) for i in spec.block_ids.tolist()]


def test_one_group_maps_key_i_to_block_i() -> None:
    blocks = geometry().resolve(4, [7, 3, 9, 1], "store")
    assert ids(blocks.all()) == [7, 3, 9, 1]
    spec, indices = blocks.prefix(2)
    assert (ids(spec), spec.group_sizes, indices) == ([7, 3], (2,), None)
    chosen = blocks.select([3, 1])
    assert (ids(chosen), chosen.group_sizes, chosen.block_indices) == ([1, 3], (2,), (3,))
    tail = blocks.tail(2)
    assert (ids(tail), tail.group_sizes, tail.block_indices) == ([9, 1], (2,), (2,))


def test_factor_two_gives_each_key_two_blocks() -> None:
    blocks = geometry(factor=2).resolve(3, [0, 1, 4, 5, 8, 9], "store")
    assert ids(blocks.prefix(2)[0]) == [0, 1, 4, 5]
    chosen = blocks.select([0, 2])
    assert (ids(chosen), chosen.block_indices) == ([0, 1, 8, 9], (0,))
    assert ids(blocks.tail(1)) == [4, 5, 8, 9] and blocks.tail(1).block_indices == (2,)
    with pytest.raises(TransferSpecError, match="3 keys need 6 GPU block ids \\(2 GPU blocks"):
        geometry(factor=2).resolve(3, [0, 1, 4], "store")


def test_a_spec_with_groups_and_a_partial_first_block() -> None:
    # factor 2; group 0: 3 GPU blocks starting mid-block (index 1) -> 2 keys;
    # group 1: 4 GPU blocks from index 0 -> 2 keys.
    spec = GPULoadStoreSpec([10, 11, 12, 20, 21, 22, 23], [3, 4], [1, 0])
    blocks = geometry(groups=2, factor=2).resolve(4, spec, "store")
    assert blocks.group_key_ranges() == [(0, 2), (2, 4)]
    prefix, keys = blocks.prefix(1)
    assert (ids(prefix), prefix.group_sizes, prefix.block_indices, keys) == (
        [10, 20, 21], (1, 2), (1, 0), [0, 2],
    )  # fmt: skip
    chosen = blocks.select([1, 3])  # the second key of each group
    assert (ids(chosen), chosen.group_sizes, chosen.block_indices) == (
        [11, 12, 22, 23], (2, 2), (2, 2),
    )  # fmt: skip
    with pytest.raises(AssertionError, match="out of order"):
        blocks.select([3, 1])
    assert ids(blocks.tail(3)) == ids(blocks.select([3])) == [22, 23]


@pytest.mark.parametrize("pick", [[0], [1], [0, 1], [1, 3], [0, 2, 3], [0, 1, 2, 3]])
def test_selected_specs_are_what_the_planner_accepts(pick: list[int]) -> None:
    """Each selection, paired with one CPU block per selected key, plans cleanly
    and moves exactly the selected keys' GPU blocks."""
    factor = 2
    kv = CanonicalKVCaches.from_engine([[torch.zeros(32, 8, dtype=torch.int8)]] * 2)
    spec = GPULoadStoreSpec([10, 11, 12, 20, 21, 22, 23], [3, 4], [1, 0])
    blocks = GpuGeometry(kv, factor).resolve(4, spec, "store")
    chosen = blocks.select(pick)
    cpu = [torch.zeros(8, 8 * factor, dtype=torch.int8) for _ in kv.tensors]
    planner = TransferPlanner(kv.group_data_refs, [t.tensor for t in kv.tensors], cpu, factor)
    plan = planner.plan((chosen, CPULoadStoreSpec(list(range(len(pick))))))
    want = {0: [10], 1: [11, 12], 2: [20, 21], 3: [22, 23]}
    assert sorted(int(r) for g in plan.groups for r in g.src_rows) == sorted(
        b for i in pick for b in want[i]
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, 2], "3 keys need 3 GPU block ids"),
        ([1, 2, 32], "GPU block id 32 .* out of range"),
        ([1, -1, 2], "GPU block id -1 .* negative"),
        ([1.0, 2.0, 3.0], "flat sequence of integers"),
        ([[1], [2], [3]], "flat sequence of integers"),
        ("abc", "flat sequence of integers"),
    ],
)
def test_bad_block_ids_name_the_problem(bad: object, message: str) -> None:
    with pytest.raises(TransferSpecError, match=message):
        geometry().resolve(3, bad, "store")


def test_several_groups_need_a_spec_and_its_key_count_must_match() -> None:
    geo = geometry(groups=2)
    with pytest.raises(TransferSpecError, match="2 groups; pass a GPULoadStoreSpec"):
        geo.resolve(2, [0, 1], "load_prefix")
    with pytest.raises(TransferSpecError, match=r"covers 3 keys .* but 4 keys"):
        geo.resolve(4, GPULoadStoreSpec([0, 1, 2], [1, 2], [0, 0]), "store")
    with pytest.raises(TransferSpecError, match="has 1 groups"):
        geo.resolve(1, GPULoadStoreSpec([0], [1], [0]), "store")
    with pytest.raises(TransferSpecError, match=r"GPU block id 40 .*group 1"):
        geo.resolve(2, GPULoadStoreSpec([0, 40], [1, 1], [0, 0]), "store")


def test_a_caller_array_is_copied_so_later_edits_do_not_reach_a_copy() -> None:
    given = np.array([1, 2, 3], dtype=np.int64)
    blocks = geometry().resolve(3, given, "store")
    given[0] = 30
    assert ids(blocks.all()) == [1, 2, 3]
