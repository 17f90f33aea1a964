"""The small value types that travel between the manager and the workers.

The manager (control plane) decides *which* blocks move and describes them
with a :class:`LoadStoreSpec`; a handler (data plane) turns a pair of specs
into copies. Everything here is plain data: no I/O, no asyncio, no CUDA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from aiokvo._util import check_int
from aiokvo.errors import ConfigError, InvalidSpecError
from aiokvo.keys import OffloadKey

__all__ = [
    "BlockIDsLoadStoreSpec",
    "BlockMetadata",
    "CPULoadStoreSpec",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "ReqContext",
    "StoreReservation",
    "TransferResult",
    "TransferSpec",
    "TransferType",
]

BlockIds: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]]"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockMetadata:
    """What a KV-aware router needs to index a request's blocks.

    Managers ignore it; KV-event publishers (``aiokvo.telemetry.kv_events``)
    put it in their ``BlockStored`` events, because routers drop events that
    carry no tokens. It describes a request's keys in order from its first
    block: key ``i`` covers ``blocks_per_key`` router blocks of ``block_size``
    tokens each, i.e. ``token_ids[i * n : (i + 1) * n]`` with
    ``n = blocks_per_key * block_size``. ``block_hashes`` (one per router
    block, needed when ``blocks_per_key > 1``) are then the hashes published
    for those blocks, as vLLM publishes its GPU blocks; otherwise each key
    publishes its own block hash. ``parent_block_hash`` is the hash of the
    block before the first key (None at the start of a sequence);
    ``extra_keys`` holds one entry per router block (vLLM's untagged form).
    """

    token_ids: Sequence[int]
    block_size: int
    blocks_per_key: int = 1
    block_hashes: Sequence[bytes] | None = None
    parent_block_hash: bytes | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, minimum=1)
        per_key = check_int("blocks_per_key", self.blocks_per_key, minimum=1)
        tokens = self.token_ids
        if isinstance(tokens, str | bytes) or not hasattr(tokens, "__len__"):
            raise ConfigError(f"token_ids must be a sequence of ints, got {tokens!r}")
        if not isinstance(tokens, list | tuple):  # numpy arrays, ranges: encoders want lists
            tolist = getattr(tokens, "tolist", None)
            object.__setattr__(self, "token_ids", tolist() if tolist else list(tokens))
        if per_key > 1 and self.block_hashes is None:
            raise ConfigError(
                f"blocks_per_key={per_key} needs block_hashes (one per block of "
                f"{self.block_size} tokens) to publish"
            )

    @property
    def tokens_per_key(self) -> int:
        """Tokens one key covers (``blocks_per_key * block_size``)."""
        return self.blocks_per_key * self.block_size


@dataclass(slots=True)
class ReqContext:
    """Per-request data a manager may consult (opaque to the built-in ones).

    ``block_metadata`` describes the request's tokens for KV-event consumers
    (see :class:`BlockMetadata`); managers never read it. Pass the same
    context to every call of one request: a manager with
    ``recency="request"`` keeps the request's record of use on it (in a
    private slot, so it goes away with the context).
    """

    kv_transfer_params: dict[str, Any] | None = None
    block_metadata: BlockMetadata | None = None
    _access: object = field(default=None, init=False, repr=False, compare=False)


class LoadStoreSpec(ABC):
    """Where a set of blocks lives on one medium, as a worker needs to know it."""

    __slots__ = ()

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """Name of the medium (``"GPU"``, ``"CPU"``); workers route on it."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec that is a flat list of block ids, kept as an int64 array.

    The array form lets handlers compute copy addresses with vectorised
    numpy instead of Python loops. The spec owns a read-only copy of the
    ids: a handler validates them when the transfer is submitted and copies
    later, so a caller's array changed in between must not redirect the copy
    to blocks nobody checked.
    """

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: BlockIds) -> None:
        if isinstance(block_ids, list | tuple) and bool in map(type, block_ids):
            # numpy reads True as 1: a bool here is a caller's bug, never a block id.
            raise InvalidSpecError(f"block_ids must be ints, got a bool in {block_ids!r}")
        ids = np.asarray(block_ids)
        if ids.size == 0:
            ids = np.empty(0, dtype=np.int64)
        if ids.ndim != 1:
            raise InvalidSpecError(f"block_ids must be one-dimensional, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidSpecError(f"block_ids must be integers, got dtype {ids.dtype}")
        owned = ids is not block_ids and ids.base is None  # made here from a list
        ids = ids.astype(np.int64, copy=not owned)  # a copy unless made here
        if ids.size and int(ids.min()) < 0:
            raise InvalidSpecError(f"block_ids must be >= 0, got {int(ids.min())}")
        ids.setflags(write=False)
        self.block_ids: npt.NDArray[np.int64] = ids

    def __len__(self) -> int:
        return int(self.block_ids.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_ids={self.block_ids.tolist()!r})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the CPU pool, addressed by offloaded-block id."""

    __slots__ = ()

    @staticmethod
    def medium() -> str:
        return "CPU"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks of one request, split by KV-cache group.

    ``group_sizes[i]`` GPU blocks of ``block_ids`` belong to group ``i``, in
    order. ``block_indices[i]`` is the logical index (within the request) of
    group ``i``'s first block: when an offloaded block spans several GPU
    blocks, ``block_indices[i] % block_size_factor`` is how many GPU-sized
    sub-blocks of the first offloaded block to skip.
    """

    __slots__ = ("block_indices", "group_sizes")

    def __init__(
        self,
        block_ids: BlockIds,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> None:
        super().__init__(block_ids)
        sizes = _int_tuple("group_sizes", group_sizes)
        indices = _int_tuple("block_indices", block_indices)
        if len(indices) != len(sizes):
            raise InvalidSpecError(
                f"block_indices has {len(indices)} entries but group_sizes has {len(sizes)}"
            )
        if sum(sizes) != len(self):
            raise InvalidSpecError(
                f"group_sizes {sizes!r} add up to {sum(sizes)}, "
                f"but there are {len(self)} block_ids"
            )
        self.group_sizes: tuple[int, ...] = sizes
        self.block_indices: tuple[int, ...] = indices

    @staticmethod
    def medium() -> str:
        return "GPU"

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec(block_ids={self.block_ids.tolist()!r}, "
            f"group_sizes={self.group_sizes!r}, block_indices={self.block_indices!r})"
        )


_COMPLETED = object()  # a reservation's holder once its manager completed it


class StoreReservation:
    """The identity of one ``prepare_store``: the keys it reserved, and who may complete them.

    ``manager.complete_store(out.reservation, success)`` completes exactly
    the keys this reservation still holds: never keys another store
    reserved, even after this store's keys failed and were prepared again.
    A reservation completes once; the manager that made it raises
    :class:`~aiokvo.errors.StaleReservationError` for a second completion
    (docs/manager.md, "Reservations").

    It iterates as its keys, so a manager that does not know reservations
    completes it as the plain key list it is.
    """

    __slots__ = ("_held", "_holder", "keys")

    def __init__(self, keys: Sequence[OffloadKey], holder: object = None) -> None:
        self.keys: tuple[OffloadKey, ...] = tuple(keys)
        # Manager bookkeeping: the token of the manager holding it open (None
        # for a key list no manager holds), and how many of ``keys`` it still holds.
        self._holder = holder
        self._held = len(self.keys)

    @property
    def open(self) -> bool:
        """True while the manager that made it can still complete it."""
        return self._holder is not None and self._holder is not _COMPLETED

    @property
    def completed(self) -> bool:
        """True once the manager that made it completed it."""
        return self._holder is _COMPLETED

    def _complete(self) -> None:
        self._holder = _COMPLETED
        self._held = 0

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __repr__(self) -> str:
        state = "completed" if self.completed else "open" if self.open else "a key list"
        return f"<StoreReservation {state}, {len(self.keys)} keys>"


_PLAIN_INT = frozenset((int,))


def _int_tuple(name: str, values: Sequence[int]) -> tuple[int, ...]:
    """``values`` as a tuple of ints >= 0; ``int()`` would turn 2.9, "2" and True into ints."""
    try:
        items = tuple(values)
    except TypeError:
        raise InvalidSpecError(f"{name} must be a sequence of ints, got {values!r}") from None
    if set(map(type, items)) <= _PLAIN_INT and (not items or min(items) >= 0):
        return items  # the usual case, in C: plain ints (bool is not one), none negative
    return tuple(
        check_int(f"{name}[{i}]", v, minimum=0, error=InvalidSpecError)
        for i, v in enumerate(items)
    )


@dataclass(slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: what to write, where, what it evicted.

    ``reservation`` identifies this store's keys for ``complete_store``; a
    manager that makes none gets a key-list one (it is not open anywhere).
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]
    reservation: StoreReservation = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.reservation is None:
            self.reservation = StoreReservation(self.keys_to_store)  # type: ignore[unreachable]


@dataclass(slots=True, frozen=True)
class OffloadingEvent:
    """Keys that became readable (``removed=False``) or were dropped (``removed=True``)."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


TransferSpec: TypeAlias = tuple[LoadStoreSpec, LoadStoreSpec]
"""``(src_spec, dst_spec)``."""

TransferType: TypeAlias = tuple[str, str]
"""``(src_medium, dst_medium)``, e.g. ``("GPU", "CPU")``."""


@dataclass(slots=True, frozen=True)
class TransferResult:
    """How one transfer ended.

    ``transfer_size`` is in bytes and ``transfer_time`` in seconds. When
    ``success`` is false, ``error`` holds the exception that stopped it and
    the destination blocks must be treated as unwritten.
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: TransferType | None = None
    error: BaseException | None = field(default=None, compare=False)
