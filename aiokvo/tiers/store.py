"""``BlockStore``: a tier's byte I/O, blocking, run on the tier's threads (never the loop).

A store is what a new tier writes: how one block's bytes go between the CPU
pool's rows and the medium, and how it tells good bytes from bad. The
engine (:class:`~aiokvo.tiers.engine.StoreTier`) does everything else. A
store gets:

* at bind, a :class:`StoreBinding` (the layout fingerprint, the pool's rows
  as :class:`PoolRows`, the settings) and answers with its
  :class:`~aiokvo.tiers.index.Index`;
* per transfer, a :class:`BlockJob`: the tier-side spec (keys, places,
  outcomes), the pool row and KV group of each block, and the deadline. It
  moves the bytes, verifies what it reads, and fills every block's
  :class:`~aiokvo.tiers.outcome.Outcome`; it may raise once it has (the
  first error is the transfer's).

Optional capabilities are flags with a default, not more abstract methods
(:class:`StoreCapabilities`): a remote store answers ``exists`` and may run
its own ``probe``; a store that connects may fail ``open`` with
:class:`~aiokvo.errors.TierUnavailableError` and be retried; a store that
sees other writers refreshes with ``maintenance``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.lib.stride_tricks import as_strided

from aiokvo.errors import TransferSpecError
from aiokvo.keys import GROUP_IDX_BYTES, MAX_KEY_BYTES, OffloadKey, get_offload_group_idx
from aiokvo.tiers.base import TierStatistics
from aiokvo.tiers.fingerprint import LayoutFingerprint
from aiokvo.tiers.index import Index
from aiokvo.tiers.outcome import Outcomes
from aiokvo.tiers.settings import TierSettings
from aiokvo.tiers.spec import TierSpec

if TYPE_CHECKING:
    import torch

    from aiokvo.config import OffloadConfig
    from aiokvo.layout import CanonicalKVCaches
    from aiokvo.manager.sink import EventSink

__all__ = ["BlockJob", "BlockStore", "PoolRows", "StoreBinding", "StoreCapabilities"]

Apply = Callable[[Index], None]
"""What a store's blocking maintenance found, applied to its index on the loop."""


class PoolRows:
    """The CPU pool as a store sees it: each KV group's block is a full row of each
    canonical tensor the group uses, back to back.

    ``cpu_tensors[i]`` is the pool of canonical tensor ``i`` (``(num_blocks, row
    bytes)`` int8, rows contiguous, any row stride); ``row_tail_bytes`` is the
    room after every row that is this tier's alone (0: none).
    """

    def __init__(
        self,
        cpu_tensors: Sequence[torch.Tensor],
        fingerprint: LayoutFingerprint,
        *,
        row_tail_bytes: int = 0,
    ) -> None:
        if not cpu_tensors:
            raise TransferSpecError("a tier needs the CPU pool's tensors")
        self.tensors = tuple(cpu_tensors)
        self.num_blocks = min(int(t.shape[0]) for t in cpu_tensors)
        self.views = [t.numpy().view(np.uint8) for t in cpu_tensors]  # the pool: no copy
        self.base = [int(t.data_ptr()) for t in cpu_tensors]
        self.stride = [int(t.stride(0)) * t.element_size() for t in cpu_tensors]
        self.width = [int(t.shape[1]) * t.element_size() for t in cpu_tensors]
        if tuple(self.width) != fingerprint.tensor_row_bytes:
            raise TransferSpecError(
                f"the CPU pool's rows are {self.width} bytes, the layout's "
                f"{list(fingerprint.tensor_row_bytes)}"
            )
        groups = range(len(fingerprint.group_refs))
        self.group_tensors = [fingerprint.group_tensors(g) for g in groups]
        self.payload = [fingerprint.payload_bytes(g) for g in groups]
        self.row_tail_bytes = row_tail_bytes
        # Each tensor's rows as one flat byte view, from its first row to the end of its
        # last: a block's buffers are slices of it (a memoryview slice costs a fraction
        # of a numpy row view and its buffer export, which a transfer pays per block).
        n = self.num_blocks
        self._flat = [
            as_strided(view, shape=(stride * (n - 1) + width,), strides=(1,)).data
            if n else memoryview(b"")
            for view, stride, width in zip(self.views, self.stride, self.width, strict=True)
        ]  # fmt: skip

    def group_of(self, key: OffloadKey) -> int:
        """``key``'s KV group, checked against the layout."""
        group = get_offload_group_idx(key)
        if group >= len(self.payload):
            raise TransferSpecError(
                f"key {key.hex()} is of KV group {group}; the layout has {len(self.payload)}"
            )
        return group

    def groups_of(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Each key's KV group, checked against the layout (with one group, one quick
        pass: every key must then end in group 0's suffix)."""
        if len(self.payload) == 1 and _all_group_zero(keys):
            return [0] * len(keys)
        return [self.group_of(key) for key in keys]

    def buffers(self, group: int, row: int) -> list[memoryview]:
        """Block ``row`` of ``group``: one flat byte view of its row per tensor (never the
        tail room)."""
        flat, stride, width = self._flat, self.stride, self.width
        return [
            flat[t][row * stride[t] : row * stride[t] + width[t]] for t in self.group_tensors[group]
        ]

    def blocks(
        self, groups: Sequence[int], rows: Sequence[int], ids: Iterable[int]
    ) -> list[list[memoryview]]:
        """:meth:`buffers` of blocks ``ids`` (block ``i`` is row ``rows[i]`` of group
        ``groups[i]``) in one pass: a store asks for a run's blocks at once."""
        flat, stride, width, tensors = self._flat, self.stride, self.width, self.group_tensors
        return [
            [flat[t][rows[i] * stride[t] : rows[i] * stride[t] + width[t]]
             for t in tensors[groups[i]]]
            for i in ids
        ]  # fmt: skip

    def payload_bytes(self, key: OffloadKey) -> int:
        return self.payload[get_offload_group_idx(key)]


def _all_group_zero(keys: Sequence[object]) -> bool:
    """Every one of ``keys`` is an OffloadKey of group 0, checked without a Python call
    per key (a promotion of 2048 blocks: 0.5 ms of the loop before, 0.2 now)."""
    if not keys:
        return True
    try:  # bytes.endswith refuses anything that is not bytes (a subclass passes)
        if not all(map(bytes.endswith, keys, repeat(_GROUP_ZERO))):  # type: ignore[arg-type]
            return False
    except TypeError:
        return False
    sizes = set(map(len, keys))  # type: ignore[arg-type]
    return min(sizes) > GROUP_IDX_BYTES and max(sizes) <= MAX_KEY_BYTES


_GROUP_ZERO = bytes(GROUP_IDX_BYTES)


@dataclass(frozen=True, slots=True)
class StoreBinding:
    """What a store is bound to: the layout ``fingerprint``, the pool's ``rows``, the
    tier's ``settings``, the pool's size, and the ``sink`` its index publishes to."""

    fingerprint: LayoutFingerprint
    rows: PoolRows
    settings: TierSettings
    pool_blocks: int
    sink: EventSink | None
    medium: str


@dataclass(slots=True, eq=False)
class BlockJob:
    """One transfer as its store runs it: ``spec`` (keys, places, outcomes), each
    block's CPU pool ``rows`` and KV ``groups``, and the ``deadline``
    (``time.monotonic()``) after which no block is started."""

    spec: TierSpec
    rows: list[int]
    groups: list[int]
    deadline: float

    @property
    def keys(self) -> tuple[OffloadKey, ...]:
        return self.spec.keys

    @property
    def where(self) -> tuple[Any, ...]:
        return self.spec.where

    @property
    def outcomes(self) -> Outcomes:
        return self.spec.outcomes

    def __len__(self) -> int:
        return len(self.rows)

    def late(self) -> bool:
        """The deadline has passed: start nothing more."""
        return time.monotonic() > self.deadline


@dataclass(frozen=True, slots=True)
class StoreCapabilities:
    """What a store can do beyond reading and writing (defaults: a local store).

    ``remote``: it answers :meth:`BlockStore.exists` (lookups ask it, within
    ``lookup_timeout`` seconds; the lookups of one loop turn share one call);
    ``probes``: it runs the breaker's half-open trial itself
    (:meth:`BlockStore.probe`), so callers never do; ``reconnects``: its
    :meth:`BlockStore.open` may fail with ``TierUnavailableError`` (or pass
    ``connect_timeout``), and the tier then starts disconnected and keeps
    trying in the background; ``maintenance_interval``: seconds between
    :meth:`BlockStore.maintenance` runs (0: only at open).
    """

    remote: bool = False
    probes: bool = False
    reconnects: bool = False
    lookup_timeout: float = 1.0
    connect_timeout: float = 30.0
    maintenance_interval: float = 0.0


class BlockStore(Protocol):
    """A tier's blocking byte I/O; see the module."""

    medium: str
    capabilities: StoreCapabilities
    statistics_type: type[TierStatistics]

    def row_tail_bytes(self, kv_caches: CanonicalKVCaches, config: OffloadConfig) -> int:
        """Room the store would like after every CPU-pool row (0: none)."""
        ...

    def bind(self, binding: StoreBinding) -> Index:
        """Prepare for ``binding``'s layout (no I/O); the index placing its blocks."""
        ...

    def open(self) -> Any:
        """Open (connect, take files); what it already holds, for ``Index.adopt``."""
        ...

    def read(self, job: BlockJob) -> None:
        """Read ``job``'s blocks into their pool rows, verify them, fill the outcomes."""
        ...

    def write(self, job: BlockJob) -> None:
        """Write ``job``'s blocks from their pool rows; fill the outcomes (and checksums)."""
        ...

    def remove(self, places: list[Any]) -> None:
        """Remove blocks holding bad bytes (best effort)."""
        ...

    def exists(self, places: list[Any]) -> list[int]:
        """Remote stores: 1 (exists), 0, or a negative code, per place."""
        ...

    def probe(self) -> bool:
        """Stores that probe: whether the store answers now (the breaker's trial)."""
        ...

    def maintenance(self, index: Index) -> Callable[[], Apply] | None:
        """On the loop: blocking work to run on a thread (what others wrote, say), whose
        result is applied to ``index`` back on the loop; None: nothing to do now. The
        result is applied even if the tier closed meanwhile (the store may be closing on
        another thread): it must then release whatever the work opened."""
        ...

    def interrupt(self) -> None:
        """The tier is closing: make a control call in flight (a connection attempt)
        return soon. Called on the loop; must not block."""
        ...

    def close(self) -> None:
        """Release files, connections and threads (blocking; once)."""
        ...

    def statistics_extra(self) -> dict[str, Any]:
        """The store's own fields of its ``statistics_type``."""
        ...
