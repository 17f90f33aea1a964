"""Load/store specs: what they accept, and that they own what they checked."""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch

from aiokvo.errors import InvalidSpecError
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec


@pytest.mark.parametrize("bad", [2.9, "2", True, None, 2.0])
@pytest.mark.parametrize("field", ["group_sizes", "block_indices"])
def test_group_fields_must_be_ints(field: str, bad: object) -> None:
    fields: dict[str, list[object]] = {"group_sizes": [2], "block_indices": [0]}
    fields[field] = [bad]
    with pytest.raises(InvalidSpecError, match=rf"{field}\[0\] must be an int >= 0, got {bad!r}"):
        GPULoadStoreSpec([0, 1], **fields)  # type: ignore[arg-type]


def test_group_fields_must_be_sequences() -> None:
    with pytest.raises(InvalidSpecError, match="group_sizes must be a sequence of ints, got 2"):
        GPULoadStoreSpec([0, 1], 2, [0])  # type: ignore[arg-type]


def test_integer_like_group_fields_are_plain_ints() -> None:
    spec = GPULoadStoreSpec([0, 1, 2], [np.int64(1), np.int32(2)], (np.uint8(0), 5))
    assert spec.group_sizes == (1, 2) and spec.block_indices == (0, 5)
    assert all(type(v) is int for v in (*spec.group_sizes, *spec.block_indices))


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.array([1, 2, 3], dtype=np.int64),
        lambda: np.array([1, 2, 3], dtype=np.int32),
        lambda: np.arange(10)[1:4],
        lambda: torch.tensor([1, 2, 3]),
        lambda: array.array("q", [1, 2, 3]),
    ],
    ids=["int64", "int32", "view", "tensor", "array"],
)
def test_a_spec_keeps_its_own_read_only_copy_of_the_ids(make: object) -> None:
    ids = make()  # type: ignore[operator]
    spec = CPULoadStoreSpec(ids)
    ids[0] = 9  # the caller's array is the caller's
    assert spec.block_ids.tolist() == [1, 2, 3]
    assert not spec.block_ids.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        spec.block_ids[0] = 9


def test_ids_from_a_list_are_not_copied_twice() -> None:
    spec = CPULoadStoreSpec([4, 5])
    assert spec.block_ids.base is None and not spec.block_ids.flags.writeable
    assert GPULoadStoreSpec([], [0], [0]).block_ids.dtype == np.int64


def test_the_managers_specs_are_read_only_too() -> None:
    from aiokvo.keys import make_offload_key
    from aiokvo.manager.cpu import CPUOffloadingManager
    from aiokvo.specs import ReqContext

    m = CPUOffloadingManager(4)
    keys = [make_offload_key(b"k%d" % i, 0) for i in range(2)]
    out = m.prepare_store(keys, ReqContext())
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert not out.store_spec.block_ids.flags.writeable
    m.complete_store(out.reservation)
    assert not m.prepare_load(keys, ReqContext()).block_ids.flags.writeable
