"""Host copies: one transfer's pages moved with a few numpy calls, never a loop per page.

A :class:`HostCopy` views a tensor's memory as pages along axis 0, the same
way on both sides, so one fancy-indexing assignment (or a ``take`` straight
into place) moves every page of a tensor. Two page views exist: ``np.void``
page elements, which numpy copies holding the GIL, and 2-D int64 word rows,
which it copies with the GIL released (so helper threads can share a
transfer). :func:`host_copy_steps` turns copies into a lazy pass of C-level
calls, which matters for the GIL convoy (see :mod:`.dispatch`).

A pool row may hold ``factor`` pages. Where rows lie back to back, sub-row
``b * factor + j`` is simply page ``b * factor + j`` of one evenly spaced
view. A shared region's rows are strided (a row's stride spans every tensor
and every rank), so their sub-rows are not evenly spaced: such a tensor is
split into ``factor`` part tensors (:func:`page_parts`), part ``j`` holding
sub-row ``j`` of every row, and a copy's pages are grouped by part
(:func:`split_by_part`).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import numpy as np
import torch

from aiokvo.errors import LayoutError
from aiokvo.plan import Int64Array

__all__ = [
    "CopyFn",
    "HostCopy",
    "apply_host_copies",
    "host_copy_steps",
    "page_elements",
    "page_parts",
    "page_voids",
    "page_words",
    "run_start",
    "split_by_bytes",
    "split_by_part",
]


@dataclass(frozen=True, slots=True)
class HostCopy:
    """Copy elements ``src_rows`` of ``src`` into elements ``dst_rows`` of ``dst``.

    ``src`` and ``dst`` view the tensors' memory as pages along axis 0, the
    same way on both sides: 2-D int64 ``(pages, page_bytes // 8)`` arrays, or
    1-D arrays of ``np.void`` page elements where pages are not whole aligned
    words (see :func:`page_elements`). ``*_start`` is the first index when
    the indices form one ascending run (a slice then replaces fancy indexing
    and saves a pass), else ``None``.
    """

    src: np.ndarray
    dst: np.ndarray
    src_rows: Int64Array
    dst_rows: Int64Array
    src_start: int | None
    dst_start: int | None

    @property
    def nbytes(self) -> int:
        src = self.src
        page = src.itemsize * (int(src.shape[1]) if src.ndim == 2 else 1)
        return int(self.src_rows.shape[0]) * page


CopyFn = Callable[[Sequence[HostCopy]], None]
"""Runs some of one transfer's copies (see :func:`apply_host_copies`)."""


_GETITEM: Callable[[Any, Any], Any] = operator.getitem
_SETITEM: Callable[[Any, Any, Any], None] = operator.setitem


def host_copy_steps(copies: Sequence[HostCopy]) -> Iterator[object]:
    """``copies`` as a lazy pass of C-level calls: exhausting it does the copies.

    Everything Python has to decide (slices for runs, which call to use) is
    decided here, up front; the returned iterator only calls numpy through
    ``map``, so running it executes no Python bytecode, and the thread that
    runs it cannot be made to give up the GIL half-way. A run on the
    destination with scattered sources is gathered straight into place
    (``ndarray.take(..., out=)``); a run on both sides is one slice
    assignment; anything else is one fancy-indexed assignment.
    """
    take_src: list[np.ndarray] = []
    take_rows: list[Int64Array] = []
    take_out: list[np.ndarray] = []
    srcs: list[np.ndarray] = []
    src_keys: list[Int64Array | slice] = []
    dsts: list[np.ndarray] = []
    dst_keys: list[Int64Array | slice] = []
    for copy in copies:
        n = int(copy.src_rows.shape[0])
        if n == 0:
            continue
        src_key: Int64Array | slice = copy.src_rows
        if copy.src_start is not None:
            src_key = slice(copy.src_start, copy.src_start + n)
        dst_key: Int64Array | slice = copy.dst_rows
        if copy.dst_start is not None:
            dst_key = slice(copy.dst_start, copy.dst_start + n)
            if copy.src_start is None:
                out = copy.dst[dst_key]
                if out.flags.c_contiguous:
                    take_src.append(copy.src)
                    take_rows.append(copy.src_rows)
                    take_out.append(out)
                    continue
        srcs.append(copy.src)
        src_keys.append(src_key)
        dsts.append(copy.dst)
        dst_keys.append(dst_key)
    moves = map(_SETITEM, dsts, dst_keys, map(_GETITEM, srcs, src_keys))
    if not take_src:
        return moves
    return chain(map(np.ndarray.take, take_src, take_rows, repeat(0), take_out), moves)


def apply_host_copies(copies: Sequence[HostCopy]) -> None:
    """Run ``copies`` on the calling thread (see :func:`host_copy_steps`)."""
    deque(host_copy_steps(copies), maxlen=0)


_WORD = 8


def _evenly_spaced(tensor: torch.Tensor, factor: int) -> bool:
    """Whether the sub-rows of ``tensor`` (``factor`` per row) are evenly spaced."""
    rows, width = (int(n) for n in tensor.shape)
    return factor == 1 or rows <= 1 or int(tensor.stride(0)) == width


def _page_rows(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray:
    """``(rows, width)`` int8 as ``(rows * factor, nbytes)`` int8: one row per page.

    Any row stride works with ``factor == 1``; with more pages per row the rows
    must lie back to back (split strided ones with :func:`page_parts` first).
    """
    array = tensor.numpy()  # a view with the tensor's strides, never a copy
    if factor > 1:
        if not _evenly_spaced(tensor, factor):
            raise LayoutError(
                f"rows of stride {tensor.stride(0)} holding {factor} pages of "
                f"{int(tensor.shape[1]) // factor} bytes are not evenly spaced; "
                "copy through page_parts()"
            )
        rows, width = array.shape
        sub = width // factor
        array = np.lib.stride_tricks.as_strided(array, (rows * factor, sub), (sub, 1))
    return array[:, :nbytes]


def page_parts(tensor: torch.Tensor, factor: int) -> tuple[torch.Tensor, ...] | None:
    """``factor`` views of ``tensor``, part ``j`` holding sub-row ``j`` of every row
    (``(rows, width // factor)``, the tensor's row stride), or ``None`` where the
    sub-rows are evenly spaced and the tensor can be paged as it is.

    Sub-row ``b * factor + j`` of the tensor is then row ``b`` of part ``j``.
    """
    if _evenly_spaced(tensor, factor):
        return None
    sub = int(tensor.shape[1]) // factor
    return tuple(tensor[:, j * sub : (j + 1) * sub] for j in range(factor))


def split_by_part(
    src_rows: Int64Array, src_parts: int, dst_rows: Int64Array, dst_parts: int
) -> list[tuple[int, Int64Array, int, Int64Array]]:
    """One copy's sub-row pairs grouped by the part each side addresses.

    A side split into ``p > 0`` parts addresses sub-row ``k`` as row ``k // p``
    of part ``k % p``; a side with ``p == 0`` is not split (part ``-1``, rows
    unchanged). Returns ``(src_part, src_rows, dst_part, dst_rows)`` per part
    pair that has pages, in part order, each keeping the pages' order.
    """
    if src_parts:
        src_rows, src_part = np.divmod(src_rows, src_parts)
    else:
        src_part = np.zeros_like(src_rows)
    if dst_parts:
        dst_rows, dst_part = np.divmod(dst_rows, dst_parts)
    else:
        dst_part = np.zeros_like(dst_rows)
    key = src_part * max(dst_parts, 1) + dst_part
    out: list[tuple[int, Int64Array, int, Int64Array]] = []
    for k in np.unique(key).tolist():
        mask = key == k
        s_part, d_part = divmod(int(k), max(dst_parts, 1))
        out.append(
            (
                s_part if src_parts else -1,
                np.ascontiguousarray(src_rows[mask]),
                d_part if dst_parts else -1,
                np.ascontiguousarray(dst_rows[mask]),
            )
        )
    return out


def page_words(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray | None:
    """The pages as an ``(pages, nbytes // 8)`` int64 array, or ``None`` where a page
    does not start on and span whole 8-byte words.

    On int64 rows numpy copies each page with a word loop and releases the GIL,
    so helper threads copy in parallel; on ``np.void`` elements it was slower on
    one thread and did not scale to two (``benchmarks/results_host.md``).
    """
    array = _page_rows(tensor, factor, nbytes)
    address = int(array.__array_interface__["data"][0])
    if nbytes % _WORD or address % _WORD or int(array.strides[0]) % _WORD:
        return None
    return array.view(np.int64)


def page_voids(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray:
    """The pages as a 1-D array of ``np.void`` elements of ``nbytes`` (any alignment)."""
    return _page_rows(tensor, factor, nbytes).view(np.dtype((np.void, nbytes))).reshape(-1)


def page_elements(tensor: torch.Tensor, factor: int, nbytes: int) -> np.ndarray:
    """The pages along axis 0: int64 words where aligned, else ``np.void`` elements.

    A copy needs the same kind on both sides; the handler checks both.
    """
    words = page_words(tensor, factor, nbytes)
    return words if words is not None else page_voids(tensor, factor, nbytes)


def split_by_bytes(copies: Sequence[HostCopy], parts: int) -> list[list[HostCopy]]:
    """Deal copies to ``parts`` shares, largest first onto the lightest share."""
    shares: list[list[HostCopy]] = [[] for _ in range(min(parts, len(copies)))]
    loads = [0] * len(shares)
    for copy in sorted(copies, key=lambda c: c.nbytes, reverse=True):
        lightest = loads.index(min(loads))
        shares[lightest].append(copy)
        loads[lightest] += copy.nbytes
    return shares


def run_start(rows: Int64Array) -> int | None:
    """The first index if ``rows`` is one ascending run (``a, a+1, ...``), else None."""
    n = int(rows.shape[0])
    if n == 0:
        return None
    if n == 1:
        return int(rows[0])
    first = int(rows[0])
    if int(rows[-1]) - first != n - 1:
        return None
    if n > 2 and not bool(np.all(np.diff(rows) == 1)):
        return None
    return first
