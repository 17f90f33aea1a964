"""``BlockRows``: where each Mooncake object's buffers are in the CPU pool.

An object is a block's pool rows (a full row of each canonical tensor its
group uses, in order) and then its 64-byte trailer
(:mod:`~aiokvo.tiers.mooncake.format`). Where the pool gave the tier room
after every row, the trailer sits right after the row of the block's last
tensor, so a one-tensor block is one buffer (``batch_put_from`` /
``batch_get_into``; Mooncake's TCP transport pays per buffer); otherwise in
a registered arena (one slot per CPU block) and the calls take several
buffers per object. Every pointer is checked to lie inside the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from aiokvo.errors import TransferSpecError
from aiokvo.keys import OffloadKey, get_offload_group_idx
from aiokvo.tiers.mooncake.format import TRAILER_BYTES
from aiokvo.tiers.store import PoolRows

__all__ = ["BlockRows", "Buffers"]

Buffers = tuple[list[int] | list[list[int]], list[int] | list[list[int]], bool]
"""Pointers and sizes of a call's objects, and whether each is one buffer (flat lists
for ``batch_put_from`` / ``batch_get_into``) or several (lists of lists)."""


class BlockRows:
    """Where each block's bytes are in the CPU pool, for pointer lists and checksums.

    ``pool`` is the CPU pool as a tier sees it. With room after every row that
    is this tier's (``pool.row_tail_bytes``), a block's trailer lives right
    after the row of the last tensor its group uses, so a one-tensor block goes
    out and in as one buffer; otherwise in ``trailers``, a ``(num_blocks, 64)``
    uint8 arena (one more buffer per block). ``layout`` is the 16 digest bytes
    every trailer carries.
    """

    def __init__(self, pool: PoolRows, layout: bytes, trailers: np.ndarray | None) -> None:
        self.pool = pool
        self.num_blocks = n = pool.num_blocks
        self._views, self._base = pool.views, pool.base
        self._stride, self._width = pool.stride, pool.width
        self.group_tensors = pool.group_tensors
        self.payload = pool.payload
        self.layout = layout
        self.in_row = pool.row_tail_bytes >= TRAILER_BYTES
        self._tail = TRAILER_BYTES if self.in_row else 0
        count = len(self.group_tensors)
        self._arena_span: tuple[int, int] | None = None
        if self.in_row:
            # The room after each row of each group's last tensor, as (n, 64) views
            # (torch checks they lie inside the pool's memory).
            self._arena = [self._room(pool.tensors[t[-1]], n) for t in self.group_tensors]
            self._trailer_base = [0] * count  # unused: a trailer extends its row's buffer
            self.single = [len(t) == 1 for t in self.group_tensors]
            return
        shape = (n, TRAILER_BYTES)
        if trailers is None or trailers.shape != shape or trailers.dtype != np.uint8:
            raise TransferSpecError(f"the trailer arena must be {shape} uint8")
        self._arena = [trailers] * count
        self._trailer_base = [int(trailers.ctypes.data)] * count
        self.single = [False] * count
        self._arena_span = (int(trailers.ctypes.data), trailers.nbytes)

    def _room(self, tensor: torch.Tensor, n: int) -> np.ndarray:
        width = int(tensor.shape[1]) * tensor.element_size()
        stride = int(tensor.stride(0)) * tensor.element_size()
        if n > 1 and stride - width < TRAILER_BYTES:
            raise TransferSpecError(
                f"CPU pool rows of {width} bytes at stride {stride} have no room for a "
                f"{TRAILER_BYTES}-byte trailer"
            )
        try:
            room = torch.as_strided(
                tensor, (n, TRAILER_BYTES), (int(tensor.stride(0)), 1),
                tensor.storage_offset() + int(tensor.shape[1]),
            )  # fmt: skip
        except RuntimeError as exc:
            raise TransferSpecError(f"the CPU pool has no room after its rows: {exc}") from exc
        return room.numpy().view(np.uint8)

    def spans(self) -> list[tuple[int, int]]:
        """``(address, length)`` of every tensor's rows (with their trailers' room) and
        of the arena: what to register."""
        n = self.num_blocks
        spans = [
            (base, stride * (n - 1) + width + self._tail)
            for base, stride, width in zip(self._base, self._stride, self._width, strict=True)
            if n
        ]
        if self._arena_span is not None:
            spans.append(self._arena_span)
        return spans

    def object_bytes(self, key: OffloadKey) -> int:
        """Bytes of ``key``'s object: payload and trailer."""
        return self.payload[get_offload_group_idx(key)] + TRAILER_BYTES

    def buffers(self, group: int, row: int) -> list[memoryview]:
        """The block's payload (its rows, never the trailer room) as views."""
        return self.pool.buffers(group, row)

    def write_trailers(self, groups: Sequence[int], rows: Sequence[int], raw: np.ndarray) -> None:
        """Store the ``(k, 64)`` trailers ``raw`` of blocks at ``rows``."""
        if not groups:
            return
        if all(g == groups[0] for g in groups):
            self._arena[groups[0]][list(rows)] = raw
            return
        for j, (group, row) in enumerate(zip(groups, rows, strict=True)):
            self._arena[group][row] = raw[j]

    def read_trailers(self, groups: Sequence[int], rows: Sequence[int]) -> np.ndarray:
        """The ``(k, 64)`` trailers of blocks at ``rows`` (a copy)."""
        if groups and all(g == groups[0] for g in groups):
            return self._arena[groups[0]][list(rows)]
        out = np.empty((len(rows), TRAILER_BYTES), dtype=np.uint8)
        for j, (group, row) in enumerate(zip(groups, rows, strict=True)):
            out[j] = self._arena[group][row]
        return out

    def pointers(self, group: int, row: int) -> tuple[list[int], list[int]]:
        """The block's buffers as ``(pointers, sizes)``, trailer last (a one-tensor
        block with its trailer in the row's room: one buffer)."""
        base, stride, width = self._base, self._stride, self._width
        tensors = self.group_tensors[group]
        ptrs = [base[t] + row * stride[t] for t in tensors]
        sizes = [width[t] for t in tensors]
        if self.in_row:
            sizes[-1] += TRAILER_BYTES
        else:
            ptrs.append(self._trailer_base[group] + row * TRAILER_BYTES)
            sizes.append(TRAILER_BYTES)
        return ptrs, sizes

    def pointer_lists(self, groups: Sequence[int], rows: Sequence[int]) -> Buffers:
        """The buffers of many blocks (one numpy pass when they share a group); flat
        lists when every block is one buffer."""
        if not groups or any(g != groups[0] for g in groups):
            pairs = [self.pointers(g, r) for g, r in zip(groups, rows, strict=True)]
            if pairs and all(len(p) == 1 for p, _ in pairs):
                return [p[0] for p, _ in pairs], [z[0] for _, z in pairs], True
            return [p for p, _ in pairs], [z for _, z in pairs], False
        group = groups[0]
        tensors = self.group_tensors[group]
        at = np.asarray(rows, dtype=np.int64)
        if self.single[group]:
            (t,) = tensors
            ptrs = self._base[t] + at * self._stride[t]
            return ptrs.tolist(), [self._width[t] + TRAILER_BYTES] * len(rows), True
        columns = [self._base[t] + at * self._stride[t] for t in tensors]
        sizes = [self._width[t] for t in tensors]
        if self.in_row:
            sizes[-1] += TRAILER_BYTES
        else:
            columns.append(self._trailer_base[group] + at * TRAILER_BYTES)
            sizes.append(TRAILER_BYTES)
        return np.stack(columns, axis=1).tolist(), [sizes] * len(rows), False
