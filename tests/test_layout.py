"""Canonical KV layout: the builders produce int8 views with one row per block."""

from __future__ import annotations

import pytest
import torch

from aiokvo.errors import LayoutError
from aiokvo.layout import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    as_block_rows,
)


def _block_bytes(tensor: torch.Tensor, block: int) -> bytes:
    return tensor[block].contiguous().view(torch.int8).numpy().tobytes()


def test_blocks_first_rows_are_views_of_each_block() -> None:
    layer = torch.randn(6, 4, 16, 8, dtype=torch.bfloat16)
    caches = CanonicalKVCaches.from_engine({"layer.0": layer})
    (t,) = caches.tensors
    assert t.tensor.shape == (6, 4 * 16 * 8 * 2)
    assert t.tensor.dtype == torch.int8
    assert t.page_size_bytes == 4 * 16 * 8 * 2
    assert caches.group_data_refs == ((CanonicalKVCacheRef(0, t.page_size_bytes),),)
    for block in range(6):
        assert t.tensor[block].numpy().tobytes() == _block_bytes(layer, block)
    # a view, not a copy: writes through the canonical row reach the layer
    t.tensor[2].zero_()
    assert not layer[2].any()
    assert layer[1].any()


def test_kv_first_splits_k_and_v_per_layer() -> None:
    layers = [torch.randn(2, 5, 3, 8, dtype=torch.float16) for _ in range(3)]
    caches = CanonicalKVCaches.from_engine(layers, layout="kv_first")
    assert len(caches.tensors) == 6
    assert caches.num_groups == 1
    refs = caches.group_data_refs[0]
    assert [r.tensor_idx for r in refs] == [0, 1, 2, 3, 4, 5]
    for i, layer in enumerate(layers):
        k, v = caches.tensors[2 * i].tensor, caches.tensors[2 * i + 1].tensor
        assert k.shape == v.shape == (5, 3 * 8 * 2)
        for block in range(5):
            assert k[block].numpy().tobytes() == _block_bytes(layer[0], block)
            assert v[block].numpy().tobytes() == _block_bytes(layer[1], block)
    assert caches.page_bytes_per_block == 6 * 48
    assert caches.copied_bytes_per_block(0) == 6 * 48


def test_several_groups_and_a_shared_tensor_are_deduplicated() -> None:
    shared = torch.randn(8, 32)
    other = torch.randn(8, 16)
    caches = CanonicalKVCaches.from_engine([[shared, other], {"x": shared}, []])
    assert len(caches.tensors) == 2
    assert [[r.tensor_idx for r in g] for g in caches.group_data_refs] == [[0, 1], [0], []]
    assert caches.num_blocks == 8
    assert caches.copied_bytes_per_block(1) == 32 * 4


def test_from_block_tensors_is_blocks_first() -> None:
    caches = CanonicalKVCaches.from_block_tensors([[torch.zeros(4, 2, 3)], [torch.zeros(4, 7)]])
    assert [t.page_size_bytes for t in caches.tensors] == [24, 28]
    assert caches.device == torch.device("cpu") and not caches.is_cuda


def test_strided_blocks_keep_their_stride() -> None:
    # (num_blocks, 2, ...) with the K half taken: blocks are 2x apart.
    raw = torch.randn(4, 2, 6)
    rows = as_block_rows(raw[:, 0])
    assert rows.shape == (4, 24)
    assert rows.stride() == (48, 1)
    assert rows[3].numpy().tobytes() == raw[3, 0].numpy().tobytes()


def test_builders_only_make_views_so_meta_tensors_work() -> None:
    # The meta device has no data: any hidden .cpu() or copy would fail here.
    layer = torch.empty(2, 10, 4, 8, dtype=torch.bfloat16, device="meta")
    caches = CanonicalKVCaches.from_engine([layer], layout="kv_first")
    assert caches.device.type == "meta"
    assert caches.tensors[1].tensor.shape == (10, 64)


@pytest.mark.parametrize(
    ("kv", "layout", "needle"),
    [
        ([torch.zeros(3, 4).t()], "blocks_first", "contiguous"),
        ([torch.zeros(3, 5, 4)], "kv_first", r"\(2, num_blocks, ...\)"),
        ([torch.zeros(0, 4)], "blocks_first", "at least one non-empty block"),
        ([torch.tensor(1.0)], "blocks_first", "0-d"),
        (torch.zeros(3, 4), "blocks_first", "not a single tensor"),
        ([[torch.zeros(3, 4)], 5], "blocks_first", "group 1 must be"),
        ([torch.zeros(3, 4)], "heads_first", "layout must be"),
    ],
)
def test_builder_rejects_bad_layouts(kv: object, layout: str, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        CanonicalKVCaches.from_engine(kv, layout=layout)  # type: ignore[arg-type]


def test_canonical_tensor_validation_names_the_bad_value() -> None:
    ok = torch.zeros(4, 16, dtype=torch.int8)
    with pytest.raises(LayoutError, match=r"2-D .* got shape \(64,\)"):
        CanonicalKVCacheTensor(ok.view(-1), 16)
    with pytest.raises(LayoutError, match=r"torch\.int8, got torch\.float32"):
        CanonicalKVCacheTensor(torch.zeros(4, 16), 16)
    with pytest.raises(LayoutError, match=r"page_size_bytes must be an int in 1\.\.16, got 17"):
        CanonicalKVCacheTensor(ok, 17)
    with pytest.raises(LayoutError, match="byte-contiguous"):
        CanonicalKVCacheTensor(ok.t(), 4)
    with pytest.raises(LayoutError, match="rows overlap"):
        CanonicalKVCacheTensor(ok.view(-1).as_strided((4, 16), (8, 1)), 16)
    padded = CanonicalKVCacheTensor(ok, 12)
    assert padded.page_size_bytes == 12 and padded.num_blocks == 4 and padded.row_stride == 16


def test_caches_validate_refs_and_devices() -> None:
    t = CanonicalKVCacheTensor(torch.zeros(4, 16, dtype=torch.int8), 16)
    with pytest.raises(LayoutError, match="tensor_idx 1, but there are only 1 tensors"):
        CanonicalKVCaches([t], [[CanonicalKVCacheRef(1, 16)]])
    with pytest.raises(LayoutError, match="reads 20 bytes per block from tensor 0"):
        CanonicalKVCaches([t], [[CanonicalKVCacheRef(0, 20)]])
    meta = CanonicalKVCacheTensor(torch.empty(4, 16, dtype=torch.int8, device="meta"), 16)
    with pytest.raises(LayoutError, match="share one device"):
        CanonicalKVCaches([t, meta], [[]])
    with pytest.raises(LayoutError, match="tensor_idx must be an int >= 0, got -1"):
        CanonicalKVCacheRef(-1, 16)
    with pytest.raises(LayoutError, match="page_size_bytes must be an int >= 1, got 0"):
        CanonicalKVCacheRef(0, 0)
    caches = CanonicalKVCaches([t], [[CanonicalKVCacheRef(0, 8)], []])
    assert caches.num_groups == 2 and caches.copied_bytes_per_block(0) == 8


def test_caches_compare_and_hash_without_touching_tensor_data() -> None:
    layer = torch.zeros(4, 16)
    a = CanonicalKVCaches.from_engine([layer])
    b = CanonicalKVCaches.from_engine([layer])
    assert a.tensors[0] == a.tensors[0] and a.tensors[0] != b.tensors[0]  # identity
    assert a == a and a != b  # no "ambiguous truth value" from tensor ==
    assert len({a.tensors[0], b.tensors[0]}) == 2
