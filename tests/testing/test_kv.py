"""make_kv_caches: engine layouts, dtypes, canonical views and block comparison."""

from __future__ import annotations

import pytest
import torch

from aiokvo.errors import ConfigError
from aiokvo.testing import make_kv_caches


@pytest.mark.parametrize(
    ("layout", "shape"),
    [("kv_first", (2, 6, 4, 2, 8)), ("blocks_first", (6, 2, 4, 2, 8))],
)
def test_layouts_have_the_engines_shape_and_one_row_per_block(
    layout: str, shape: tuple[int, ...]
) -> None:
    kv = make_kv_caches(layers=3, blocks=6, block_size=4, kv_heads=2, head_dim=8,
                        dtype=torch.float16, layout=layout)  # type: ignore[arg-type]
    assert [tuple(t.shape) for t in kv.tensors] == [shape] * 3
    assert all(t.dtype == torch.float16 for t in kv.tensors)
    assert kv.num_blocks == 6 and kv.device.type == "cpu"
    # K and V of a block: 2 * 4 tokens * 2 heads * 8 dims * 2 bytes per layer.
    assert kv.canonical.page_bytes_per_block == 3 * 2 * 4 * 2 * 8 * 2
    assert kv.block(1, 5).shape == (2, 4, 2, 8)


def test_blocks_differ_until_copied_and_seeds_repeat() -> None:
    kv = make_kv_caches(layers=2, blocks=4, kv_heads=1, head_dim=4)
    assert not kv.blocks_equal([0], [1])
    for t in kv.tensors:
        t[:, 3] = t[:, 0]
    assert kv.blocks_equal([0, 3], [3, 0])
    again = make_kv_caches(layers=2, blocks=4, kv_heads=1, head_dim=4)
    assert all(torch.equal(a[:, :3], b[:, :3]) for a, b in zip(kv.tensors, again.tensors,
                                                                 strict=True))
    other = make_kv_caches(layers=2, blocks=4, kv_heads=1, head_dim=4, seed=1)
    assert not torch.equal(kv.tensors[0], other.tensors[0])
    assert all(bool(torch.isfinite(t.float()).all()) for t in kv.tensors)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": 0}, "layers must be an int >= 1, got 0"),
        ({"layout": "heads_first"}, "layout must be one of 'kv_first', 'blocks_first'"),
        ({"dtype": "bf16"}, "dtype must be a torch.dtype, got 'bf16'"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_kv_caches(**kwargs)  # type: ignore[arg-type]


def test_comparing_different_counts_is_an_error() -> None:
    kv = make_kv_caches(layers=1, blocks=2, kv_heads=1, head_dim=2)
    with pytest.raises(ConfigError, match="got 1 and 2"):
        kv.blocks_equal([0], [0, 1])
