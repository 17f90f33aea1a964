"""Load/store specs: what they accept."""

from __future__ import annotations

import numpy as np
import pytest

from aiokvo.errors import InvalidSpecError
from aiokvo.specs import GPULoadStoreSpec


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
