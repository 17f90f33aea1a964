"""A validated transfer, and the two shapes backends consume it in.

* :meth:`TransferPlan.pointers` - flat ``src_ptrs``/``dst_ptrs``/``sizes``
  int64 arrays for a batched memcpy (the CUDA backend), each pointer checked
  to lie inside its tensor;
* :meth:`TransferPlan.row_copies` - per tensor, source and destination
  sub-row index arrays for vectorised gather/scatter (the host backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiokvo.layout import CanonicalKVCacheRef
from aiokvo.plan.rows import Int64Array, RowSpace, check_ptrs_inside, concat, sub_row_ptrs

__all__ = ["GroupRows", "PointerPlan", "RowCopy", "TransferPlan"]


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
class GroupRows:
    """One KV group's sub-rows on both sides and the tensors (refs) they cover."""

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
    groups: tuple[GroupRows, ...] = field(repr=False)

    @property
    def num_copies(self) -> int:
        """Number of page copies (pages times the layers that hold them)."""
        return sum(int(g.src_rows.shape[0]) * len(g.refs) for g in self.groups)

    def row_copies(self) -> list[RowCopy]:
        """One :class:`RowCopy` per (tensor, page size), merging all groups."""
        if len(self.groups) == 1:  # the common case: nothing to merge unless refs repeat
            group = self.groups[0]
            refs = group.refs
            if len(refs) == 1 or len({(r.tensor_idx, r.page_size_bytes) for r in refs}) == len(
                refs
            ):
                return [
                    RowCopy(r.tensor_idx, r.page_size_bytes, group.src_rows, group.dst_rows)
                    for r in refs
                ]
        merged: dict[tuple[int, int], tuple[list[Int64Array], list[Int64Array]]] = {}
        for group in self.groups:
            for ref in group.refs:
                srcs, dsts = merged.setdefault((ref.tensor_idx, ref.page_size_bytes), ([], []))
                srcs.append(group.src_rows)
                dsts.append(group.dst_rows)
        return [
            RowCopy(idx, nbytes, concat(srcs), concat(dsts))
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
            src = sub_row_ptrs(copy.src_rows, self.src_factor, src_space)
            dst = sub_row_ptrs(copy.dst_rows, self.dst_factor, dst_space)
            check_ptrs_inside(src, copy.nbytes, src_space, "source", copy.tensor_idx)
            check_ptrs_inside(dst, copy.nbytes, dst_space, "destination", copy.tensor_idx)
            src_parts.append(src)
            dst_parts.append(dst)
            size_parts.append(np.full(src.shape[0], copy.nbytes, dtype=np.int64))
        return PointerPlan(
            concat(src_parts), concat(dst_parts), concat(size_parts), self.total_bytes
        )
