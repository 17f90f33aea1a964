"""Row geometry and index math: where sub-row ``i`` of a 2-D byte tensor starts.

Everything a copy plan needs to know about a tensor is a :class:`RowSpace`.
An offloaded block may hold ``block_size_factor`` GPU pages, so a tensor is
addressed in *sub-rows*: sub-row ``b * factor + j`` is the ``j``-th
page-sized slice of row ``b``. All index math here is vectorised numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from aiokvo._util import check_int
from aiokvo.errors import TransferSpecError

__all__ = [
    "Int64Array",
    "RowSpace",
    "TensorLike",
    "as_ids",
    "check_factor",
    "check_ids_in_range",
    "check_ptrs_inside",
    "compute_sub_block_ptrs",
    "concat",
    "sub_row_ptrs",
    "sub_rows",
]

Int64Array: TypeAlias = npt.NDArray[np.int64]
TensorLike: TypeAlias = "torch.Tensor | RowSpace"


@dataclass(frozen=True, slots=True)
class RowSpace:
    """Geometry of a 2-D byte tensor, all the planner needs to know about it.

    Row ``r`` is the ``row_bytes`` bytes at ``base_ptr + r * row_stride``.
    Backends whose memory is not a torch tensor (an mmap region, a raw
    allocation) describe it with one of these directly.
    """

    base_ptr: int
    num_rows: int
    row_stride: int
    row_bytes: int

    def __post_init__(self) -> None:
        if self.num_rows < 0 or self.row_bytes <= 0:
            raise TransferSpecError(
                f"a row space needs num_rows >= 0 and row_bytes > 0, got {self.num_rows} rows "
                f"of {self.row_bytes} bytes"
            )
        if self.num_rows > 1 and self.row_stride < self.row_bytes:
            raise TransferSpecError(
                f"row stride {self.row_stride} is smaller than the row width {self.row_bytes}"
            )

    @property
    def end_ptr(self) -> int:
        """One past the last byte of the last row."""
        if self.num_rows == 0:
            return self.base_ptr
        return self.base_ptr + (self.num_rows - 1) * self.row_stride + self.row_bytes

    @classmethod
    def of(cls, tensor: TensorLike) -> RowSpace:
        """Describe a 2-D int8 tensor (rows byte-contiguous), checked against its storage."""
        if isinstance(tensor, RowSpace):
            return tensor
        if tensor.ndim != 2 or tensor.dtype != torch.int8:
            raise TransferSpecError(
                f"expected a 2-D int8 tensor, got shape {tuple(tensor.shape)} dtype {tensor.dtype}"
            )
        num_rows, row_bytes = (int(n) for n in tensor.shape)
        if row_bytes > 1 and tensor.stride(1) != 1:
            raise TransferSpecError(f"rows must be byte-contiguous, got strides {tensor.stride()}")
        stride = int(tensor.stride(0)) if num_rows > 1 else row_bytes
        space = cls(int(tensor.data_ptr()), num_rows, stride, row_bytes)
        storage = tensor.untyped_storage()
        lo, hi = int(storage.data_ptr()), int(storage.data_ptr()) + int(storage.nbytes())
        if space.num_rows and not (lo <= space.base_ptr and space.end_ptr <= hi):
            raise TransferSpecError(
                f"tensor rows [{space.base_ptr:#x}, {space.end_ptr:#x}) lie outside "
                f"their storage [{lo:#x}, {hi:#x})"
            )
        return space


def compute_sub_block_ptrs(
    block_ids: npt.NDArray[np.integer[Any]],
    block_size_factor: int,
    output: Int64Array,
    tensor: TensorLike,
    skip_count: int = 0,
) -> None:
    """Fill ``output`` with the address of each sub-block, in order.

    Block ``b`` of ``tensor`` is split into ``block_size_factor`` equal
    sub-blocks; sub-block ``j`` starts at ``base + b * row_stride + j * sub``
    where ``sub = row_bytes // block_size_factor``. Sub-blocks of
    ``block_ids`` are enumerated in order, the first ``skip_count`` are
    skipped, and the next ``len(output)`` addresses are written to ``output``.
    """
    space = RowSpace.of(tensor)
    ids = as_ids(block_ids, "block_ids")
    if output.dtype != np.int64 or output.ndim != 1:
        raise TransferSpecError(
            f"output must be a 1-D int64 array, got {output.ndim}-D {output.dtype}"
        )
    check_factor(block_size_factor)
    if not 0 <= skip_count < block_size_factor:
        raise TransferSpecError(
            f"skip_count must be in 0..{block_size_factor - 1}, got {skip_count}"
        )
    wanted = int(output.shape[0])
    available = int(ids.shape[0]) * block_size_factor - skip_count
    if wanted > available:
        raise TransferSpecError(
            f"{wanted} sub-blocks requested but {ids.shape[0]} blocks with factor "
            f"{block_size_factor} and skip_count {skip_count} hold only {max(available, 0)}"
        )
    if space.row_bytes % block_size_factor:
        raise TransferSpecError(
            f"row width {space.row_bytes} is not divisible by block_size_factor {block_size_factor}"
        )
    used = ids[: -(-(wanted + skip_count) // block_size_factor)] if wanted else ids[:0]
    check_ids_in_range(used, space.num_rows, "block id", "tensor")
    rows = sub_rows(used, block_size_factor, skip_count, wanted)
    output[:] = sub_row_ptrs(rows, block_size_factor, space)


def check_factor(block_size_factor: object) -> int:
    """``block_size_factor`` as an int >= 1, else :class:`TransferSpecError`."""
    return check_int("block_size_factor", block_size_factor, minimum=1, error=TransferSpecError)


def as_ids(block_ids: npt.NDArray[np.integer[Any]], name: str) -> Int64Array:
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise TransferSpecError(f"{name} must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64, copy=False)


def check_ids_in_range(ids: Int64Array, num_rows: int, what: str, where: object) -> None:
    """Every id in ``0..num_rows-1``, else :class:`TransferSpecError` naming the worst one.

    ``where`` says where the ids belong; a ``(template, *args)`` tuple is
    formatted only when an id is bad, so the hot path builds no string.
    """
    n = ids.size
    if n == 0:
        return
    if n <= 32:  # a few ids: Python's min/max beat numpy's reduction set-up
        listed = ids.tolist()
        lo, hi = min(listed), max(listed)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < num_rows:
        return
    place = str(where[0]).format(*where[1:]) if isinstance(where, tuple) else str(where)
    if lo < 0:
        raise TransferSpecError(f"{what} {lo} ({place}) is negative")
    raise TransferSpecError(
        f"{what} {hi} ({place}) is out of range: the tensor has {num_rows} rows"
    )


def sub_rows(ids: Int64Array, factor: int, skip: int, count: int) -> Int64Array:
    """Sub-row indices of ``count`` sub-blocks of ``ids``, after skipping ``skip``."""
    if factor == 1:
        return np.ascontiguousarray(ids[:count], dtype=np.int64)
    expanded = ids[:, np.newaxis] * factor + np.arange(factor, dtype=np.int64)
    return np.ascontiguousarray(expanded.ravel()[skip : skip + count])


def sub_row_ptrs(rows: Int64Array, factor: int, space: RowSpace) -> Int64Array:
    """The address of each sub-row of ``space`` (rows of ``row_bytes // factor`` bytes)."""
    sub_bytes = space.row_bytes // factor
    if factor == 1:
        ptrs: Int64Array = space.base_ptr + rows * space.row_stride
        return ptrs
    block, part = np.divmod(rows, factor)
    ptrs = space.base_ptr + block * space.row_stride + part * sub_bytes
    return ptrs


def check_ptrs_inside(
    ptrs: Int64Array, nbytes: int, space: RowSpace, side: str, tensor_idx: int
) -> None:
    """Every ``[ptr, ptr + nbytes)`` inside ``space``, else :class:`TransferSpecError`."""
    if ptrs.size == 0:
        return
    lo, hi = int(ptrs.min()), int(ptrs.max()) + nbytes
    if lo < space.base_ptr or hi > space.end_ptr:
        raise TransferSpecError(
            f"{side} copy [{lo:#x}, {hi:#x}) of tensor {tensor_idx} leaves the tensor "
            f"[{space.base_ptr:#x}, {space.end_ptr:#x})"
        )


def concat(parts: list[Int64Array]) -> Int64Array:
    if not parts:
        return np.empty(0, dtype=np.int64)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts)
