"""Which of the caller's GPU blocks belong to which key of one Offloader call.

The Offloader takes keys and GPU blocks side by side; the manager then picks
a subset (the reserved keys of a store, the ready prefix of a load) and the
transfer must name exactly the GPU blocks of that subset. :class:`GpuBlocks`
is that mapping, checked once when the call comes in (lengths, integer ids,
every id inside the KV tensors of its group), so that nothing a caller can
get wrong is found after the manager's state has changed. Pure: numpy only.

Two shapes of input:

* a flat sequence of GPU block ids, for KV caches with one group: key ``i``
  covers ids ``[i * factor, (i + 1) * factor)`` (``factor`` is the config's
  ``block_size_factor``, 1 unless offloaded blocks are larger than GPU
  blocks), so there are exactly ``factor * len(keys)`` ids;
* a :class:`~aiokvo.specs.GPULoadStoreSpec`, for several groups or partial
  offloaded blocks: ``keys`` lists each group's keys in group order, and
  group ``g`` has ``ceil((group_sizes[g] + block_indices[g] % factor) / factor)``
  of them, as vLLM's GPU specs are laid out.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from aiokvo.errors import TransferSpecError
from aiokvo.layout import CanonicalKVCaches
from aiokvo.plan.rows import Int64Array, check_ids_in_range
from aiokvo.specs import GPULoadStoreSpec

__all__ = ["GpuBlockIds", "GpuBlocks", "GpuGeometry"]

GpuBlockIds: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]] | GPULoadStoreSpec"
"""What the Offloader's calls accept as ``gpu_block_ids``."""


def _gpu_spec(
    ids: Int64Array, sizes: tuple[int, ...], indices: tuple[int, ...]
) -> GPULoadStoreSpec:
    """A ``GPULoadStoreSpec`` from parts this module checked (skips the constructor)."""
    spec = GPULoadStoreSpec.__new__(GPULoadStoreSpec)
    spec.block_ids = ids
    spec.group_sizes = sizes
    spec.block_indices = indices
    return spec


class GpuGeometry:
    """What checking GPU block ids needs to know about the KV caches; built once.

    ``rows[g]`` is the number of GPU blocks every tensor of group ``g`` has
    (its smallest tensor's row count), ``factor`` the GPU blocks per key.
    """

    __slots__ = ("factor", "num_groups", "rows")

    def __init__(self, kv_caches: CanonicalKVCaches, factor: int) -> None:
        self.factor = factor
        self.num_groups = kv_caches.num_groups
        self.rows = tuple(
            min((kv_caches.tensors[r.tensor_idx].num_blocks for r in refs), default=0)
            for refs in kv_caches.group_data_refs
        )

    def resolve(
        self, num_keys: int, gpu_block_ids: object, what: str, *, distinct: bool = False
    ) -> GpuBlocks:
        """Check ``gpu_block_ids`` against ``num_keys`` keys and the tensors.

        Raises :class:`~aiokvo.errors.TransferSpecError` naming the problem;
        ``what`` names the call in the message. With ``distinct`` (loads, which
        write the blocks) no GPU block of a group may be named twice.
        """
        if isinstance(gpu_block_ids, GPULoadStoreSpec):
            return self._resolve_spec(num_keys, gpu_block_ids, what, distinct)
        if self.num_groups != 1:
            raise TransferSpecError(
                f"{what}: the KV caches have {self.num_groups} groups; pass a GPULoadStoreSpec "
                f"that says which GPU blocks belong to which group, not a flat list"
            )
        factor = self.factor
        if type(gpu_block_ids) is list:  # the common case: a few Python ints
            ids = _list_ids(gpu_block_ids, self.rows[0], what)
        else:
            ids = _as_ids(gpu_block_ids, what)
            check_ids_in_range(ids, self.rows[0], "GPU block id", f"{what}, group 0")
        if ids.shape[0] != num_keys * factor:
            per_key = "one GPU block" if factor == 1 else f"{factor} GPU blocks"
            raise TransferSpecError(
                f"{what}: {num_keys} keys need {num_keys * factor} GPU block ids "
                f"({per_key} per key), got {ids.shape[0]}"
            )
        if distinct:
            _check_distinct(ids, what, 0)
        return GpuBlocks(ids, factor, None, num_keys)

    def _resolve_spec(
        self, num_keys: int, spec: GPULoadStoreSpec, what: str, distinct: bool
    ) -> GpuBlocks:
        if len(spec.group_sizes) != self.num_groups:
            raise TransferSpecError(
                f"{what}: the GPU spec has {len(spec.group_sizes)} groups "
                f"(group_sizes={spec.group_sizes!r}) but the KV caches have {self.num_groups}"
            )
        factor = self.factor
        groups: list[_Group] = []
        block_start = key_start = 0
        for g, (size, first) in enumerate(zip(spec.group_sizes, spec.block_indices, strict=True)):
            skip = first % factor
            count = -(-(size + skip) // factor) if size else 0
            ids = spec.block_ids[block_start : block_start + size]
            check_ids_in_range(ids, self.rows[g], "GPU block id", f"{what}, group {g}")
            if distinct:
                _check_distinct(ids, what, g)
            groups.append(_Group(g, first, skip, size, block_start, key_start, count))
            block_start += size
            key_start += count
        if key_start != num_keys:
            raise TransferSpecError(
                f"{what}: the GPU spec covers {key_start} keys (group_sizes "
                f"{spec.group_sizes!r}, block_indices {spec.block_indices!r}, "
                f"block_size_factor {factor}), but {num_keys} keys were given"
            )
        return GpuBlocks(spec.block_ids, factor, tuple(groups), num_keys)


class _Group:
    """One group of a GPU spec: its GPU blocks and the flat indices of its keys."""

    __slots__ = ("block_start", "count", "first", "index", "key_start", "size", "skip")

    def __init__(
        self, index: int, first: int, skip: int, size: int, block_start: int, key_start: int,
        count: int,
    ) -> None:  # fmt: skip
        self.index = index
        self.first = first  # logical index (in the request) of the group's first GPU block
        self.skip = skip  # GPU sub-blocks of the first key that are not in this spec
        self.size = size
        self.block_start = block_start
        self.key_start = key_start
        self.count = count


class GpuBlocks:
    """One call's GPU blocks, checked, keyed by the index of each key in the call.

    Build with :meth:`GpuGeometry.resolve`. ``num_keys`` keys; :meth:`all`,
    :meth:`prefix` and :meth:`select` give the ``GPULoadStoreSpec`` of all of
    them, of a prefix of each group, or of chosen keys.
    """

    __slots__ = ("_factor", "_groups", "_ids", "num_keys")

    def __init__(
        self, ids: Int64Array, factor: int, groups: tuple[_Group, ...] | None, num_keys: int
    ) -> None:
        self._ids = ids
        self._factor = factor
        self._groups = groups  # None: one group, ``factor`` ids per key, nothing skipped
        self.num_keys = num_keys

    @property
    def num_groups(self) -> int:
        return 1 if self._groups is None else len(self._groups)

    def group_key_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of each group's keys in the call's key list."""
        if self._groups is None:
            return [(0, self.num_keys)]
        return [(g.key_start, g.key_start + g.count) for g in self._groups]

    def all(self) -> GPULoadStoreSpec:
        """The spec of every key's GPU blocks."""
        if self._groups is None:
            return _gpu_spec(self._ids, (self._ids.shape[0],), (0,))
        return _gpu_spec(
            self._ids,
            tuple(g.size for g in self._groups),
            tuple(g.first for g in self._groups),
        )

    def prefix(self, n: int) -> tuple[GPULoadStoreSpec, list[int] | None]:
        """The spec of the first ``n`` keys of every group, and those keys' indices.

        The indices are None when they are simply ``range(n)`` (one group).
        """
        if self._groups is None:
            ids = self._ids[: n * self._factor]
            return _gpu_spec(ids, (ids.shape[0],), (0,)), None
        factor = self._factor
        parts: list[Int64Array] = []
        sizes: list[int] = []
        keys: list[int] = []
        for g in self._groups:
            take = min(n, g.count)
            size = min(g.size, take * factor - g.skip) if take else 0
            parts.append(self._ids[g.block_start : g.block_start + size])
            sizes.append(size)
            keys.extend(range(g.key_start, g.key_start + take))
        ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return _gpu_spec(ids, tuple(sizes), tuple(g.first for g in self._groups)), keys

    def tail(self, start: int) -> GPULoadStoreSpec:
        """The spec of keys ``start`` to the last (a store whose prefix is held)."""
        if self._groups is None:
            first = start * self._factor
            ids = self._ids[first:]
            return _gpu_spec(ids, (ids.shape[0],), (first,))
        return self.select(range(start, self.num_keys))

    def select(self, indices: Sequence[int]) -> GPULoadStoreSpec:
        """The spec of the keys at ``indices`` (call order), their blocks in that order.

        With one group and ``factor`` 1 any order works; otherwise ``indices``
        must increase (a manager reserves keys in the order it was given them),
        else :class:`AssertionError`.
        """
        factor = self._factor
        if self._groups is None:
            start = indices[0] * factor if len(indices) else 0
            if factor == 1:
                ids = self._ids[np.asarray(indices, dtype=np.int64)]
                return _gpu_spec(ids, (ids.shape[0],), (start,))
            assert _increasing(indices), f"keys selected out of order: {list(indices)}"
            rows = self._ids.reshape(self.num_keys, factor)[np.asarray(indices, dtype=np.int64)]
            return _gpu_spec(rows.reshape(-1), (rows.size,), (start,))
        assert _increasing(indices), f"keys selected out of order: {list(indices)}"
        parts: list[Int64Array] = []
        sizes: list[int] = []
        firsts: list[int] = []
        it = iter(indices)
        index = next(it, None)
        for g in self._groups:
            stop = g.key_start + g.count
            size = 0
            first: int | None = None
            while index is not None and index < stop:
                j = index - g.key_start
                lo = max(0, j * factor - g.skip)
                hi = min(g.size, (j + 1) * factor - g.skip)
                if first is None:
                    first = g.first + lo
                parts.append(self._ids[g.block_start + lo : g.block_start + hi])
                size += hi - lo
                index = next(it, None)
            sizes.append(size)
            firsts.append(0 if first is None else first)
        ids = np.concatenate(parts) if parts else self._ids[:0]
        return _gpu_spec(ids, tuple(sizes), tuple(firsts))


def _increasing(indices: Sequence[int]) -> bool:
    return all(a < b for a, b in pairwise(indices))


def _check_distinct(ids: Int64Array, what: str, group: int) -> None:
    """No GPU block named twice: a load would write two keys' bytes into one block."""
    n = ids.shape[0]
    if n < 2:
        return
    listed = ids.tolist()
    if n <= 64:
        if len(set(listed)) == n:
            return
    else:
        ordered = np.sort(ids)
        if not (ordered[1:] == ordered[:-1]).any():
            return
    first: dict[int, int] = {}
    for i, block in enumerate(listed):
        if block in first:
            raise TransferSpecError(
                f"{what}: GPU block {block} (group {group}) is named twice, at positions "
                f"{first[block]} and {i}: one load would write two keys into it"
            )
        first[block] = i


def _refuse_bools(value: Sequence[Any], what: str) -> None:
    """``True`` is an int to numpy (block 1): a bool among block ids is a caller's bug."""
    if bool in map(type, value):
        raise TransferSpecError(f"{what}: GPU block ids must be ints, got a bool in {value!r}")


def _list_ids(value: list[Any], rows: int, what: str) -> Int64Array:
    """A list of block ids as int64, each checked to be an int in ``0..rows-1``."""
    _refuse_bools(value, what)
    ids = np.array(value)
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        if not value:
            return ids.astype(np.int64)
        raise TransferSpecError(
            f"{what}: GPU block ids must be a flat sequence of integers, got {value!r}"
        )
    if value and (min(value) < 0 or max(value) >= rows):
        check_ids_in_range(ids, rows, "GPU block id", f"{what}, group 0")  # raises, naming it
    return ids if ids.dtype == np.int64 else ids.astype(np.int64)


def _as_ids(value: object, what: str) -> Int64Array:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        _refuse_bools(value, what)
    try:
        ids = np.asarray(value)
    except (TypeError, ValueError):
        raise TransferSpecError(f"{what}: GPU block ids must be integers, got {value!r}") from None
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise TransferSpecError(
            f"{what}: GPU block ids must be a flat sequence of integers, got {value!r} "
            f"(dtype {ids.dtype})"
        )
    ids = ids.astype(np.int64, copy=False)
    if ids.flags.writeable and ids is value:
        ids = ids.copy()  # the caller's array: later edits must not change a queued copy
    return ids
