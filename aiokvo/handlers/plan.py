"""Copy plans: which bytes move where for one transfer, checked before anything moves.

A transfer is a pair of specs, one GPU-side (:class:`GPULoadStoreSpec`, block
ids split by KV-cache group) and one offload-side (e.g. :class:`CPULoadStoreSpec`).
An offloaded block may hold ``block_size_factor`` GPU blocks, so the offload
side is addressed in *sub-rows*: sub-row ``b * factor + j`` is the ``j``-th
GPU-block-sized slice of offloaded block ``b``. Within each group the offload
side's sub-rows start at ``block_indices[g] % factor`` (a request whose first
block is not aligned to an offloaded block skips that many sub-rows).

:func:`plan_transfer` (or :meth:`TransferPlanner.plan`, which a handler keeps
so that the checks that do not depend on the spec run once) validates
everything a caller could get wrong (route, group count, group sizes against
the offload spec's length, every block id against the row count of every
tensor it touches) and raises
:class:`~aiokvo.errors.TransferSpecError` naming the bad value *before* any
copy could be enqueued. The resulting :class:`TransferPlan` renders two ways:

* :meth:`TransferPlan.pointers` - flat ``src_ptrs``/``dst_ptrs``/``sizes``
  int64 arrays for a batched memcpy (the CUDA backend), each pointer checked
  to lie inside its tensor;
* :meth:`TransferPlan.row_copies` - per tensor, source and destination
  sub-row index arrays for vectorised gather/scatter (the host backend).

All index math is numpy-vectorised: the only Python loops are per group and
per tensor, never per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

import numpy as np
import numpy.typing as npt
import torch

from aiokvo.errors import TransferSpecError
from aiokvo.layout import CanonicalKVCacheRef
from aiokvo.specs import BlockIDsLoadStoreSpec, GPULoadStoreSpec, TransferSpec

__all__ = [
    "Int64Array",
    "PointerPlan",
    "RowCopy",
    "RowSpace",
    "TensorLike",
    "TransferPlan",
    "TransferPlanner",
    "compute_sub_block_ptrs",
    "plan_copy_ptrs",
    "plan_transfer",
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
    ids = _as_ids(block_ids, "block_ids")
    if output.dtype != np.int64 or output.ndim != 1:
        raise TransferSpecError(
            f"output must be a 1-D int64 array, got {output.ndim}-D {output.dtype}"
        )
    _check_factor(block_size_factor)
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
    _check_ids_in_range(used, space.num_rows, "block id", "tensor")
    sub = _sub_rows(used, block_size_factor, skip_count, wanted)
    output[:] = _sub_row_ptrs(sub, block_size_factor, space)


@dataclass(frozen=True, slots=True)
class PointerPlan:
    """A flat batch of copies: ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]``."""

    src_ptrs: Int64Array
    dst_ptrs: Int64Array
    sizes: Int64Array
    total_bytes: int

    def __len__(self) -> int:
        return int(self.sizes.shape[0])


@dataclass(frozen=True, slots=True)
class RowCopy:
    """Copy the first ``nbytes`` of sub-rows ``src_rows`` of source tensor
    ``tensor_idx`` into sub-rows ``dst_rows`` of destination tensor ``tensor_idx``.

    Sub-rows index the tensor viewed as ``(num_rows * factor, row_bytes // factor)``,
    where ``factor`` is :attr:`TransferPlan.src_factor` / :attr:`TransferPlan.dst_factor`.
    """

    tensor_idx: int
    nbytes: int
    src_rows: Int64Array
    dst_rows: Int64Array

    @property
    def total_bytes(self) -> int:
        return int(self.src_rows.shape[0]) * self.nbytes


@dataclass(frozen=True, slots=True)
class _GroupRows:
    src_rows: Int64Array
    dst_rows: Int64Array
    refs: tuple[CanonicalKVCacheRef, ...]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A validated transfer; render it with :meth:`pointers` or :meth:`row_copies`."""

    src_factor: int
    dst_factor: int
    src_spaces: tuple[RowSpace, ...]
    dst_spaces: tuple[RowSpace, ...]
    total_bytes: int
    _groups: tuple[_GroupRows, ...] = field(repr=False)

    @property
    def num_copies(self) -> int:
        """Number of page copies (pages times the layers that hold them)."""
        return sum(int(g.src_rows.shape[0]) * len(g.refs) for g in self._groups)

    def row_copies(self) -> list[RowCopy]:
        """One :class:`RowCopy` per (tensor, page size), merging all groups."""
        if len(self._groups) == 1:  # the common case: nothing to merge unless refs repeat
            group = self._groups[0]
            refs = group.refs
            if len(refs) == 1 or len({(r.tensor_idx, r.page_size_bytes) for r in refs}) == len(
                refs
            ):
                return [
                    RowCopy(r.tensor_idx, r.page_size_bytes, group.src_rows, group.dst_rows)
                    for r in refs
                ]
        merged: dict[tuple[int, int], tuple[list[Int64Array], list[Int64Array]]] = {}
        for group in self._groups:
            for ref in group.refs:
                srcs, dsts = merged.setdefault((ref.tensor_idx, ref.page_size_bytes), ([], []))
                srcs.append(group.src_rows)
                dsts.append(group.dst_rows)
        return [
            RowCopy(idx, nbytes, _concat(srcs), _concat(dsts))
            for (idx, nbytes), (srcs, dsts) in merged.items()
        ]

    def pointers(self) -> PointerPlan:
        """Flat pointer arrays for a batched memcpy, each copy checked against its tensor."""
        src_parts: list[Int64Array] = []
        dst_parts: list[Int64Array] = []
        size_parts: list[Int64Array] = []
        for copy in self.row_copies():
            src_space = self.src_spaces[copy.tensor_idx]
            dst_space = self.dst_spaces[copy.tensor_idx]
            src = _sub_row_ptrs(copy.src_rows, self.src_factor, src_space)
            dst = _sub_row_ptrs(copy.dst_rows, self.dst_factor, dst_space)
            _check_ptrs_inside(src, copy.nbytes, src_space, "source", copy.tensor_idx)
            _check_ptrs_inside(dst, copy.nbytes, dst_space, "destination", copy.tensor_idx)
            src_parts.append(src)
            dst_parts.append(dst)
            size_parts.append(np.full(src.shape[0], copy.nbytes, dtype=np.int64))
        return PointerPlan(
            _concat(src_parts), _concat(dst_parts), _concat(size_parts), self.total_bytes
        )


def plan_transfer(
    transfer_spec: TransferSpec,
    group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    src_tensors: Sequence[TensorLike],
    dst_tensors: Sequence[TensorLike],
    block_size_factor: int,
) -> TransferPlan:
    """Validate a transfer and compute its sub-row indices.

    ``src_tensors[i]`` and ``dst_tensors[i]`` are the two sides of canonical
    tensor ``i`` (``CanonicalKVCacheRef.tensor_idx``): the GPU side has one
    row per GPU block, the offload side one row per offloaded block, i.e.
    ``block_size_factor`` GPU pages. Which side is which follows from which
    spec is the :class:`GPULoadStoreSpec`.
    """
    _check_factor(block_size_factor)
    src_spec, dst_spec = _unpack(transfer_spec)
    gpu_is_src = isinstance(src_spec, GPULoadStoreSpec)
    if len(src_tensors) != len(dst_tensors):
        raise TransferSpecError(
            f"{len(src_tensors)} source tensors but {len(dst_tensors)} destination tensors"
        )
    src_spaces = tuple(RowSpace.of(t) for t in src_tensors)
    dst_spaces = tuple(RowSpace.of(t) for t in dst_tensors)
    gpu_spec = src_spec if gpu_is_src else dst_spec
    assert isinstance(gpu_spec, GPULoadStoreSpec)
    _check_group_count(gpu_spec, len(group_data_refs))
    groups = _prepare_groups(group_data_refs, src_spaces, dst_spaces, gpu_is_src, block_size_factor)
    return _plan_groups(
        src_spec, dst_spec, gpu_is_src, groups, src_spaces, dst_spaces, block_size_factor
    )


class TransferPlanner:
    """Plans many transfers between the same tensors (what a handler does).

    Everything that does not depend on the spec -- tensor geometry, each
    ref's page size against both sides, which tensor of a group has the
    fewest rows -- is checked once and kept, so :meth:`plan` only does the
    per-transfer work. :meth:`plan` returns what :func:`plan_transfer`
    returns for the same arguments and raises the same errors.
    """

    __slots__ = ("_dst", "_factor", "_kinds", "_prepared", "_refs", "_src")

    def __init__(
        self,
        group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        src_tensors: Sequence[TensorLike],
        dst_tensors: Sequence[TensorLike],
        block_size_factor: int,
    ) -> None:
        _check_factor(block_size_factor)
        self._factor = int(block_size_factor)
        self._refs = tuple(tuple(g) for g in group_data_refs)
        self._src = tuple(RowSpace.of(t) for t in src_tensors)
        self._dst = tuple(RowSpace.of(t) for t in dst_tensors)
        # Per direction (keyed by "the GPU side is the source"); None: a check failed,
        # so plan() defers to plan_transfer, which raises the precise error.
        self._prepared: dict[bool, tuple[_GroupInfo, ...] | None] = {}
        self._kinds: dict[tuple[type, type], bool] = {}

    def plan(self, transfer_spec: TransferSpec) -> TransferPlan:
        try:
            src_spec, dst_spec = transfer_spec
        except (TypeError, ValueError):
            _unpack(transfer_spec)  # raises the precise error
            raise
        # Spec types seen before need no isinstance checks (ABC checks are not free).
        kinds = (type(src_spec), type(dst_spec))
        gpu_is_src = self._kinds.get(kinds)
        if gpu_is_src is None:
            _unpack(transfer_spec)
            gpu_is_src = self._kinds[kinds] = isinstance(src_spec, GPULoadStoreSpec)
        groups = self._prepared.get(gpu_is_src, _UNSET)
        if groups is _UNSET:
            groups = self._prepare(gpu_is_src)
        if groups is None:
            return plan_transfer(transfer_spec, self._refs, self._src, self._dst, self._factor)
        gpu_spec = cast(GPULoadStoreSpec, src_spec if gpu_is_src else dst_spec)
        if len(gpu_spec.group_sizes) != len(groups):
            _check_group_count(gpu_spec, len(groups))
        return _plan_groups(
            cast(BlockIDsLoadStoreSpec, src_spec),
            cast(BlockIDsLoadStoreSpec, dst_spec),
            gpu_is_src,
            groups,
            self._src,
            self._dst,
            self._factor,
        )

    def _prepare(self, gpu_is_src: bool) -> tuple[_GroupInfo, ...] | None:
        try:
            if len(self._src) != len(self._dst):
                raise TransferSpecError("tensor counts differ")
            groups: tuple[_GroupInfo, ...] | None = _prepare_groups(
                self._refs, self._src, self._dst, gpu_is_src, self._factor
            )
        except TransferSpecError:
            groups = None
        self._prepared[gpu_is_src] = groups
        return groups


@dataclass(frozen=True, slots=True)
class _GroupInfo:
    """What a group's plan needs that does not depend on the spec."""

    refs: tuple[CanonicalKVCacheRef, ...]
    gpu_rows: int  # rows of the group's smallest GPU-side tensor ...
    gpu_tensor: int  # ... which is this one
    offload_rows: int
    offload_tensor: int
    bytes_per_block: int


_UNSET: Any = object()


def _check_group_count(gpu_spec: GPULoadStoreSpec, num_groups: int) -> None:
    if len(gpu_spec.group_sizes) != num_groups:
        raise TransferSpecError(
            f"the GPU spec has {len(gpu_spec.group_sizes)} groups "
            f"(group_sizes={gpu_spec.group_sizes!r}) but the KV caches have {num_groups}"
        )


def _prepare_groups(
    group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    src_spaces: tuple[RowSpace, ...],
    dst_spaces: tuple[RowSpace, ...],
    gpu_is_src: bool,
    factor: int,
) -> tuple[_GroupInfo, ...]:
    gpu_spaces, offload_spaces = (
        (src_spaces, dst_spaces) if gpu_is_src else (dst_spaces, src_spaces)
    )
    for g, refs in enumerate(group_data_refs):
        for ref in refs:
            _check_ref(ref, g, gpu_spaces, offload_spaces, factor)
    infos: list[_GroupInfo] = []
    for refs in group_data_refs:
        refs = tuple(refs)
        if not refs:
            infos.append(_GroupInfo(refs, 0, 0, 0, 0, 0))
            continue
        # Ids are checked against the smallest tensor the group touches, once per side.
        gpu_rows, gpu_t = min((gpu_spaces[r.tensor_idx].num_rows, r.tensor_idx) for r in refs)
        off_rows, off_t = min((offload_spaces[r.tensor_idx].num_rows, r.tensor_idx) for r in refs)
        size = sum(ref.page_size_bytes for ref in refs)
        infos.append(_GroupInfo(refs, gpu_rows, gpu_t, off_rows, off_t, size))
    return tuple(infos)


def _plan_groups(
    src_spec: BlockIDsLoadStoreSpec,
    dst_spec: BlockIDsLoadStoreSpec,
    gpu_is_src: bool,
    infos: tuple[_GroupInfo, ...],
    src_spaces: tuple[RowSpace, ...],
    dst_spaces: tuple[RowSpace, ...],
    factor: int,
) -> TransferPlan:
    """The per-transfer part of planning: group sizes against the offload spec, id ranges."""
    gpu_spec, offload_spec = (src_spec, dst_spec) if gpu_is_src else (dst_spec, src_spec)
    gpu_spec = cast(GPULoadStoreSpec, gpu_spec)
    sizes = gpu_spec.group_sizes
    if len(sizes) == 1 and factor == 1:  # the common case, without the general bookkeeping
        size, info = sizes[0], infos[0]
        n_offload = int(offload_spec.block_ids.shape[0])
        if size != n_offload:
            _raise_count_mismatch(gpu_spec, offload_spec, factor, size)
        if size == 0 or not info.refs:
            groups: list[_GroupRows] = []
            total = 0
        else:
            gpu_ids, offload_ids = gpu_spec.block_ids, offload_spec.block_ids
            _check_group_ids(gpu_ids, offload_ids, info, 0, offload_spec)
            src_rows, dst_rows = (gpu_ids, offload_ids) if gpu_is_src else (offload_ids, gpu_ids)
            groups = [_GroupRows(src_rows, dst_rows, info.refs)]
            total = size * info.bytes_per_block
    else:
        groups, total = _plan_general(gpu_spec, offload_spec, gpu_is_src, infos, factor)
    return TransferPlan(
        src_factor=1 if gpu_is_src else factor,
        dst_factor=factor if gpu_is_src else 1,
        src_spaces=src_spaces,
        dst_spaces=dst_spaces,
        total_bytes=total,
        _groups=tuple(groups),
    )


def _plan_general(
    gpu_spec: GPULoadStoreSpec,
    offload_spec: BlockIDsLoadStoreSpec,
    gpu_is_src: bool,
    infos: tuple[_GroupInfo, ...],
    factor: int,
) -> tuple[list[_GroupRows], int]:
    sizes = gpu_spec.group_sizes
    skips = [idx % factor for idx in gpu_spec.block_indices]
    offload_counts = [
        -(-(size + skip) // factor) if size else 0 for size, skip in zip(sizes, skips, strict=True)
    ]
    if sum(offload_counts) != len(offload_spec):
        _raise_count_mismatch(gpu_spec, offload_spec, factor, sum(offload_counts))
    groups: list[_GroupRows] = []
    total = 0
    gpu_start = offload_start = 0
    for g, (size, skip, count, info) in enumerate(
        zip(sizes, skips, offload_counts, infos, strict=True)
    ):
        gpu_ids = gpu_spec.block_ids[gpu_start : gpu_start + size]
        offload_ids = offload_spec.block_ids[offload_start : offload_start + count]
        gpu_start += size
        offload_start += count
        if size == 0 or not info.refs:
            continue
        _check_group_ids(gpu_ids, offload_ids, info, g, offload_spec)
        offload_rows = _sub_rows(offload_ids, factor, skip, size)
        src_rows, dst_rows = (gpu_ids, offload_rows) if gpu_is_src else (offload_rows, gpu_ids)
        groups.append(_GroupRows(src_rows, dst_rows, info.refs))
        total += size * info.bytes_per_block
    return groups, total


def _raise_count_mismatch(
    gpu_spec: GPULoadStoreSpec, offload_spec: BlockIDsLoadStoreSpec, factor: int, need: int
) -> None:
    raise TransferSpecError(
        f"the {offload_spec.medium()} spec has {len(offload_spec)} blocks, but group sizes "
        f"{gpu_spec.group_sizes!r} with block_indices {gpu_spec.block_indices!r} and "
        f"block_size_factor {factor} need {need}"
    )


def _check_group_ids(
    gpu_ids: Int64Array,
    offload_ids: Int64Array,
    info: _GroupInfo,
    g: int,
    offload_spec: BlockIDsLoadStoreSpec,
) -> None:
    """Every id of group ``g`` against the smallest tensor it touches, on both sides."""
    if _ids_in_range(gpu_ids, info.gpu_rows) and _ids_in_range(offload_ids, info.offload_rows):
        return
    _check_ids_in_range(
        gpu_ids, info.gpu_rows, "GPU block id", f"group {g}, tensor {info.gpu_tensor}"
    )
    _check_ids_in_range(
        offload_ids,
        info.offload_rows,
        f"{offload_spec.medium()} block id",
        f"group {g}, tensor {info.offload_tensor}",
    )


def _ids_in_range(ids: Int64Array, num_rows: int) -> bool:
    n = ids.size
    if n == 0:
        return True
    if n <= 32:  # a few ids: Python's min/max beat numpy's reduction set-up
        listed = ids.tolist()
        return bool(min(listed) >= 0 and max(listed) < num_rows)
    return bool(int(ids.min()) >= 0 and int(ids.max()) < num_rows)


def plan_copy_ptrs(
    transfer_spec: TransferSpec,
    group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    src_tensors: Sequence[TensorLike],
    dst_tensors: Sequence[TensorLike],
    block_size_factor: int,
) -> PointerPlan:
    """``plan_transfer(...).pointers()``: the flat batch a DMA engine wants."""
    return plan_transfer(
        transfer_spec, group_data_refs, src_tensors, dst_tensors, block_size_factor
    ).pointers()


# -- helpers ------------------------------------------------------------------------


def _unpack(
    transfer_spec: TransferSpec,
) -> tuple[BlockIDsLoadStoreSpec, BlockIDsLoadStoreSpec]:
    try:
        src_spec, dst_spec = transfer_spec
    except (TypeError, ValueError):
        raise TransferSpecError(
            f"a transfer spec is a (src_spec, dst_spec) pair, got {transfer_spec!r}"
        ) from None
    if not isinstance(src_spec, BlockIDsLoadStoreSpec):
        raise TransferSpecError(f"source spec must list block ids, got {src_spec!r}")
    if not isinstance(dst_spec, BlockIDsLoadStoreSpec):
        raise TransferSpecError(f"destination spec must list block ids, got {dst_spec!r}")
    if isinstance(src_spec, GPULoadStoreSpec) == isinstance(dst_spec, GPULoadStoreSpec):
        raise TransferSpecError(
            f"exactly one side must be a GPULoadStoreSpec, got {src_spec.medium()} -> "
            f"{dst_spec.medium()}"
        )
    return src_spec, dst_spec


def _check_factor(block_size_factor: int) -> None:
    if isinstance(block_size_factor, bool) or not isinstance(block_size_factor, int | np.integer):
        raise TransferSpecError(f"block_size_factor must be an int, got {block_size_factor!r}")
    if block_size_factor < 1:
        raise TransferSpecError(f"block_size_factor must be >= 1, got {block_size_factor}")


def _check_ref(
    ref: CanonicalKVCacheRef,
    group: int,
    gpu_spaces: tuple[RowSpace, ...],
    offload_spaces: tuple[RowSpace, ...],
    factor: int,
) -> None:
    idx = ref.tensor_idx
    if not 0 <= idx < len(gpu_spaces):
        raise TransferSpecError(
            f"group {group} refers to tensor {idx}, but there are {len(gpu_spaces)} tensors"
        )
    gpu, offload = gpu_spaces[idx], offload_spaces[idx]
    if offload.row_bytes % factor:
        raise TransferSpecError(
            f"offload tensor {idx} rows are {offload.row_bytes} bytes, "
            f"not divisible by block_size_factor {factor}"
        )
    room = min(gpu.row_bytes, offload.row_bytes // factor)
    if ref.page_size_bytes > room:
        raise TransferSpecError(
            f"group {group} copies {ref.page_size_bytes} bytes per page of tensor {idx}, "
            f"but a page there holds only {room} bytes"
        )


def _as_ids(block_ids: npt.NDArray[np.integer[Any]], name: str) -> Int64Array:
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise TransferSpecError(f"{name} must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64, copy=False)


def _check_ids_in_range(ids: Int64Array, num_rows: int, what: str, where: str) -> None:
    n = ids.size
    if n == 0:
        return
    if n <= 32:  # a few ids: Python's min/max beat numpy's reduction set-up
        listed = ids.tolist()
        lo, hi = min(listed), max(listed)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise TransferSpecError(f"{what} {lo} ({where}) is negative")
    if hi >= num_rows:
        raise TransferSpecError(
            f"{what} {hi} ({where}) is out of range: the tensor has {num_rows} rows"
        )


def _sub_rows(ids: Int64Array, factor: int, skip: int, count: int) -> Int64Array:
    """Sub-row indices of ``count`` sub-blocks of ``ids``, after skipping ``skip``."""
    if factor == 1:
        return np.ascontiguousarray(ids[:count], dtype=np.int64)
    expanded = ids[:, np.newaxis] * factor + np.arange(factor, dtype=np.int64)
    return np.ascontiguousarray(expanded.ravel()[skip : skip + count])


def _sub_row_ptrs(rows: Int64Array, factor: int, space: RowSpace) -> Int64Array:
    sub_bytes = space.row_bytes // factor
    if factor == 1:
        ptrs: Int64Array = space.base_ptr + rows * space.row_stride
        return ptrs
    block, part = np.divmod(rows, factor)
    ptrs = space.base_ptr + block * space.row_stride + part * sub_bytes
    return ptrs


def _check_ptrs_inside(
    ptrs: Int64Array, nbytes: int, space: RowSpace, side: str, tensor_idx: int
) -> None:
    if ptrs.size == 0:
        return
    lo, hi = int(ptrs.min()), int(ptrs.max()) + nbytes
    if lo < space.base_ptr or hi > space.end_ptr:
        raise TransferSpecError(
            f"{side} copy [{lo:#x}, {hi:#x}) of tensor {tensor_idx} leaves the tensor "
            f"[{space.base_ptr:#x}, {space.end_ptr:#x})"
        )


def _concat(parts: list[Int64Array]) -> Int64Array:
    if not parts:
        return np.empty(0, dtype=np.int64)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts)
