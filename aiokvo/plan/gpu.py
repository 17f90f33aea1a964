"""Plans for transfers between the KV caches and an offload pool (GPU <-> CPU rows).

One side is a :class:`GPULoadStoreSpec` (block ids split by KV-cache group),
the other a flat block-id spec of the offload medium (e.g.
:class:`CPULoadStoreSpec`), whose rows hold ``block_size_factor`` GPU pages.
Within each group the offload side's sub-rows start at
``block_indices[g] % factor`` (a request whose first block is not aligned to
an offloaded block skips that many sub-rows).

:class:`TransferPlanner` is the one entry point. A handler builds it once
over its tensors, so the checks that do not depend on the spec (tensor
geometry, each ref's page size against both sides, which tensor of a group
has the fewest rows) run once; :meth:`TransferPlanner.plan` then checks what
a caller could get wrong in one transfer (exactly one GPU side, group
count, group sizes against the offload spec's length, every block id
against the rows of every tensor it touches) and raises
:class:`~aiokvo.errors.TransferSpecError` naming the bad value *before*
any copy could be enqueued. The only Python loops are per group and per
tensor, never per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from aiokvo.errors import TransferSpecError
from aiokvo.layout import CanonicalKVCacheRef
from aiokvo.plan.rows import (
    Int64Array,
    RowSpace,
    TensorLike,
    check_factor,
    check_ids_in_range,
    sub_rows,
)
from aiokvo.plan.transfer import GroupRows, TransferPlan
from aiokvo.specs import BlockIDsLoadStoreSpec, GPULoadStoreSpec, TransferSpec

__all__ = ["TransferPlanner"]


@dataclass(frozen=True, slots=True)
class _GroupInfo:
    """What a group's plan needs that does not depend on the spec."""

    refs: tuple[CanonicalKVCacheRef, ...]
    gpu_rows: int  # rows of the group's smallest GPU-side tensor ...
    gpu_tensor: int  # ... which is this one
    offload_rows: int
    offload_tensor: int
    bytes_per_block: int


class TransferPlanner:
    """Plans many transfers between the same tensors (what a handler keeps).

    ``src_tensors[i]`` and ``dst_tensors[i]`` are the two sides of canonical
    tensor ``i`` (``CanonicalKVCacheRef.tensor_idx``): the GPU side has one
    row per GPU block, the offload side one row per offloaded block, i.e.
    ``block_size_factor`` GPU pages. Which side is which follows from which
    spec of a transfer is the :class:`GPULoadStoreSpec`.
    """

    __slots__ = ("_dst", "_factor", "_kinds", "_prepared", "_refs", "_src")

    def __init__(
        self,
        group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        src_tensors: Sequence[TensorLike],
        dst_tensors: Sequence[TensorLike],
        block_size_factor: int,
    ) -> None:
        self._factor = check_factor(block_size_factor)
        self._refs = tuple(tuple(g) for g in group_data_refs)
        self._src = tuple(RowSpace.of(t) for t in src_tensors)
        self._dst = tuple(RowSpace.of(t) for t in dst_tensors)
        # Per direction, keyed by "the GPU side is the source"; only checks that passed.
        self._prepared: dict[bool, tuple[_GroupInfo, ...]] = {}
        self._kinds: dict[tuple[type, type], bool] = {}

    def plan(self, transfer_spec: TransferSpec) -> TransferPlan:
        """Validate one transfer and compute its sub-row indices."""
        try:
            src_spec, dst_spec = transfer_spec
        except (TypeError, ValueError):
            raise TransferSpecError(
                f"a transfer spec is a (src_spec, dst_spec) pair, got {transfer_spec!r}"
            ) from None
        # Spec types seen before need no isinstance checks (ABC checks are not free).
        kinds = (type(src_spec), type(dst_spec))
        gpu_is_src = self._kinds.get(kinds)
        if gpu_is_src is None:
            gpu_is_src = self._kinds[kinds] = _gpu_is_src(src_spec, dst_spec)
        groups = self._prepared.get(gpu_is_src)
        if groups is None:
            groups = self._prepared[gpu_is_src] = self._prepare(gpu_is_src)
        gpu_spec = cast(GPULoadStoreSpec, src_spec if gpu_is_src else dst_spec)
        if len(gpu_spec.group_sizes) != len(groups):
            raise TransferSpecError(
                f"the GPU spec has {len(gpu_spec.group_sizes)} groups "
                f"(group_sizes={gpu_spec.group_sizes!r}) but the KV caches have {len(groups)}"
            )
        return _plan_groups(
            cast(BlockIDsLoadStoreSpec, src_spec),
            cast(BlockIDsLoadStoreSpec, dst_spec),
            gpu_is_src,
            groups,
            self._src,
            self._dst,
            self._factor,
        )

    def _prepare(self, gpu_is_src: bool) -> tuple[_GroupInfo, ...]:
        """The spec-independent checks of one direction; raises until they pass."""
        if len(self._src) != len(self._dst):
            raise TransferSpecError(
                f"{len(self._src)} source tensors but {len(self._dst)} destination tensors"
            )
        gpu_spaces, offload_spaces = (
            (self._src, self._dst) if gpu_is_src else (self._dst, self._src)
        )
        for g, refs in enumerate(self._refs):
            for ref in refs:
                _check_ref(ref, g, gpu_spaces, offload_spaces, self._factor)
        infos: list[_GroupInfo] = []
        for refs in self._refs:
            if not refs:
                infos.append(_GroupInfo(refs, 0, 0, 0, 0, 0))
                continue
            # Ids are checked against the smallest tensor the group touches, once per side.
            gpu_rows, gpu_t = min((gpu_spaces[r.tensor_idx].num_rows, r.tensor_idx) for r in refs)
            off_rows, off_t = min(
                (offload_spaces[r.tensor_idx].num_rows, r.tensor_idx) for r in refs
            )
            size = sum(ref.page_size_bytes for ref in refs)
            infos.append(_GroupInfo(refs, gpu_rows, gpu_t, off_rows, off_t, size))
        return tuple(infos)


def _gpu_is_src(src_spec: object, dst_spec: object) -> bool:
    """Which side is the GPU one; exactly one side must be, and both must list block ids."""
    if not isinstance(src_spec, BlockIDsLoadStoreSpec):
        raise TransferSpecError(f"source spec must list block ids, got {src_spec!r}")
    if not isinstance(dst_spec, BlockIDsLoadStoreSpec):
        raise TransferSpecError(f"destination spec must list block ids, got {dst_spec!r}")
    gpu_is_src = isinstance(src_spec, GPULoadStoreSpec)
    if gpu_is_src == isinstance(dst_spec, GPULoadStoreSpec):
        raise TransferSpecError(
            f"exactly one side must be a GPULoadStoreSpec, got {src_spec.medium()} -> "
            f"{dst_spec.medium()}"
        )
    return gpu_is_src


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
            groups: list[GroupRows] = []
            total = 0
        else:
            gpu_ids, offload_ids = gpu_spec.block_ids, offload_spec.block_ids
            _check_group_ids(gpu_ids, offload_ids, info, 0, offload_spec)
            src_rows, dst_rows = (gpu_ids, offload_ids) if gpu_is_src else (offload_ids, gpu_ids)
            groups = [GroupRows(src_rows, dst_rows, info.refs)]
            total = size * info.bytes_per_block
    else:
        groups, total = _plan_general(gpu_spec, offload_spec, gpu_is_src, infos, factor)
    return TransferPlan(
        src_factor=1 if gpu_is_src else factor,
        dst_factor=factor if gpu_is_src else 1,
        src_spaces=src_spaces,
        dst_spaces=dst_spaces,
        total_bytes=total,
        groups=tuple(groups),
    )


def _plan_general(
    gpu_spec: GPULoadStoreSpec,
    offload_spec: BlockIDsLoadStoreSpec,
    gpu_is_src: bool,
    infos: tuple[_GroupInfo, ...],
    factor: int,
) -> tuple[list[GroupRows], int]:
    sizes = gpu_spec.group_sizes
    skips = [idx % factor for idx in gpu_spec.block_indices]
    offload_counts = [
        -(-(size + skip) // factor) if size else 0 for size, skip in zip(sizes, skips, strict=True)
    ]
    if sum(offload_counts) != len(offload_spec):
        _raise_count_mismatch(gpu_spec, offload_spec, factor, sum(offload_counts))
    groups: list[GroupRows] = []
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
        offload_rows = sub_rows(offload_ids, factor, skip, size)
        src_rows, dst_rows = (gpu_ids, offload_rows) if gpu_is_src else (offload_rows, gpu_ids)
        groups.append(GroupRows(src_rows, dst_rows, info.refs))
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
    where = "group {}, tensor {}"
    check_ids_in_range(gpu_ids, info.gpu_rows, "GPU block id", (where, g, info.gpu_tensor))
    check_ids_in_range(
        offload_ids,
        info.offload_rows,
        offload_spec.medium() + " block id",
        (where, g, info.offload_tensor),
    )


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
