"""Canonical KV-cache layout: every engine tensor seen as ``(num_blocks, page_bytes)`` bytes.

Attention backends lay KV caches out differently: most put the block
dimension first, ``(num_blocks, ...)``, while FlashAttention stacks K and V
in front of it, ``(2, num_blocks, ...)``. Copy planning only needs "row ``b``
of tensor ``t`` holds block ``b``", so the builders here turn each layout
into int8 *views* (never copies, never ``.cpu()``) with one row per block.
The same objects work for CPU and CUDA tensors.

``CanonicalKVCaches.group_data_refs[g]`` lists, for KV-cache group ``g``,
which canonical tensors hold that group's data and how many bytes of each
row are real data (the rest of a row may be padding).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from aiokvo._util import check_int, check_text
from aiokvo.errors import LayoutError

__all__ = [
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "EngineKVCaches",
    "KVLayout",
    "as_block_rows",
]

KVLayout: TypeAlias = Literal["blocks_first", "kv_first"]
"""``"blocks_first"``: ``(num_blocks, ...)``; ``"kv_first"``: ``(2, num_blocks, ...)``."""

_LayerTensors: TypeAlias = "Mapping[str, torch.Tensor] | Sequence[torch.Tensor]"
EngineKVCaches: TypeAlias = "Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Sequence[Mapping[str, torch.Tensor] | Sequence[torch.Tensor]]"  # noqa: E501
"""One group of layers (a name→tensor mapping or a list), or a list of such groups."""


@dataclass(frozen=True, slots=True, eq=False)  # tensors have no boolean ==; compare by identity
class CanonicalKVCacheTensor:
    """A 2-D int8 tensor with one row per block.

    ``page_size_bytes`` is the (possibly padded) page size: the number of
    leading bytes of each row that belong to the block. Rows must be
    byte-contiguous (``stride(1) == 1``) and must not overlap
    (``stride(0) >= shape[1]``), so that row ``b`` is exactly the bytes at
    ``data_ptr() + b * stride(0)``.
    """

    tensor: torch.Tensor
    page_size_bytes: int

    def __post_init__(self) -> None:
        t = self.tensor
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"tensor must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 2:
            raise LayoutError(
                f"canonical tensor must be 2-D (num_blocks, page_bytes), got shape {tuple(t.shape)}"
            )
        if t.dtype != torch.int8:
            raise LayoutError(f"canonical tensor must have dtype torch.int8, got {t.dtype}")
        num_blocks, row_bytes = t.shape
        if row_bytes > 1 and t.stride(1) != 1:
            raise LayoutError(f"rows must be byte-contiguous (stride(1) == 1), got {t.stride()}")
        if num_blocks > 1 and t.stride(0) < row_bytes:
            raise LayoutError(
                f"row stride {t.stride(0)} is smaller than the row width {row_bytes}: rows overlap"
            )
        page = check_int(
            "page_size_bytes", self.page_size_bytes, minimum=1, maximum=row_bytes, error=LayoutError
        )
        object.__setattr__(self, "page_size_bytes", page)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> CanonicalKVCacheTensor:
        """Wrap any ``(num_blocks, ...)`` tensor; the page is the whole row."""
        rows = as_block_rows(tensor)
        return cls(rows, int(rows.shape[1]))

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def row_stride(self) -> int:
        """Bytes from one row's start to the next."""
        return int(self.tensor.stride(0)) if self.num_blocks > 1 else int(self.tensor.shape[1])

    @property
    def device(self) -> torch.device:
        return self.tensor.device


@dataclass(frozen=True, slots=True)
class CanonicalKVCacheRef:
    """One layer's (or layer group's) use of a canonical tensor.

    ``page_size_bytes`` is the layer's unpadded page size; only that many
    leading bytes of each row are copied.
    """

    tensor_idx: int
    page_size_bytes: int

    def __post_init__(self) -> None:
        for name, minimum in (("tensor_idx", 0), ("page_size_bytes", 1)):
            value = check_int(name, getattr(self, name), minimum=minimum, error=LayoutError)
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class CanonicalKVCaches:
    """All KV-cache tensors of a worker, canonicalised, plus per-group references.

    Every tensor lives on the same device. Build one with :meth:`from_engine`
    (or :meth:`from_block_tensors`) rather than by hand where possible.
    ``dtype`` names the engine tensors' element type (``"bfloat16"``; several
    joined by ``","``): the canonical views are int8, and a tier's layout
    fingerprint needs what the bytes mean. :meth:`from_engine` records it; by
    hand, pass it (None: unknown, and a tier then wants it in its settings).
    """

    tensors: tuple[CanonicalKVCacheTensor, ...]
    group_data_refs: tuple[tuple[CanonicalKVCacheRef, ...], ...]
    dtype: str | None

    def __init__(
        self,
        tensors: Iterable[CanonicalKVCacheTensor],
        group_data_refs: Iterable[Iterable[CanonicalKVCacheRef]],
        *,
        dtype: str | None = None,
    ) -> None:
        object.__setattr__(self, "tensors", tuple(tensors))
        object.__setattr__(self, "group_data_refs", tuple(tuple(g) for g in group_data_refs))
        if dtype is not None:
            check_text("dtype", dtype, error=LayoutError)
        object.__setattr__(self, "dtype", dtype)
        self._validate()

    def _validate(self) -> None:
        for i, t in enumerate(self.tensors):
            if not isinstance(t, CanonicalKVCacheTensor):
                raise LayoutError(f"tensors[{i}] must be a CanonicalKVCacheTensor, got {t!r}")
        devices = {t.device for t in self.tensors}
        if len(devices) > 1:
            names = sorted(str(d) for d in devices)
            raise LayoutError(f"all KV-cache tensors must share one device, got {names}")
        for g, refs in enumerate(self.group_data_refs):
            for ref in refs:
                if not isinstance(ref, CanonicalKVCacheRef):
                    raise LayoutError(f"group {g} holds {ref!r}, not a CanonicalKVCacheRef")
                if ref.tensor_idx >= len(self.tensors):
                    raise LayoutError(
                        f"group {g} refers to tensor_idx {ref.tensor_idx}, "
                        f"but there are only {len(self.tensors)} tensors"
                    )
                page = self.tensors[ref.tensor_idx].page_size_bytes
                if ref.page_size_bytes > page:
                    raise LayoutError(
                        f"group {g} reads {ref.page_size_bytes} bytes per block from tensor "
                        f"{ref.tensor_idx}, whose page is only {page} bytes"
                    )

    # -- builders ---------------------------------------------------------------

    @classmethod
    def from_engine(
        cls, kv_caches: EngineKVCaches, *, layout: KVLayout = "blocks_first"
    ) -> CanonicalKVCaches:
        """Canonicalise an engine's per-layer KV tensors (views only).

        ``kv_caches`` is one KV-cache group, given as a ``{layer_name: tensor}``
        mapping (layers in mapping order) or a list of tensors, or a list of
        such groups. With ``layout="blocks_first"`` each tensor is
        ``(num_blocks, ...)`` and becomes one canonical tensor; with
        ``layout="kv_first"`` each is ``(2, num_blocks, ...)`` and becomes a
        K and a V tensor. A tensor shared by several layers or groups is
        canonicalised once and referenced from each.
        """
        if layout not in ("blocks_first", "kv_first"):
            raise LayoutError(f"layout must be 'blocks_first' or 'kv_first', got {layout!r}")
        groups = _split_groups(kv_caches)
        tensors: list[CanonicalKVCacheTensor] = []
        seen: dict[tuple[object, ...], int] = {}
        group_refs: list[list[CanonicalKVCacheRef]] = []
        dtypes: dict[str, None] = {}
        for layers in groups:
            refs: list[CanonicalKVCacheRef] = []
            for name, raw in layers:
                dtypes[str(raw.dtype).removeprefix("torch.")] = None
                for part in _split_kv(raw, layout, name):
                    identity = _identity(part)
                    idx = seen.get(identity)
                    if idx is None:
                        try:
                            canonical = CanonicalKVCacheTensor.of(part)
                        except LayoutError as exc:
                            raise LayoutError(f"layer {name}: {exc}") from None
                        idx = seen[identity] = len(tensors)
                        tensors.append(canonical)
                    refs.append(CanonicalKVCacheRef(idx, tensors[idx].page_size_bytes))
            group_refs.append(refs)
        return cls(tensors, group_refs, dtype=",".join(dtypes) or None)

    @classmethod
    def from_block_tensors(
        cls, tensors_per_group: Sequence[Sequence[torch.Tensor]]
    ) -> CanonicalKVCaches:
        """Shorthand for ``from_engine(groups, layout="blocks_first")``."""
        return cls.from_engine(list(tensors_per_group), layout="blocks_first")

    # -- facts planners and allocators need ------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.group_data_refs)

    @property
    def device(self) -> torch.device:
        """The device every tensor lives on (CPU when there are none)."""
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def num_blocks(self) -> int:
        """Blocks addressable in every tensor (the smallest row count)."""
        return min((t.num_blocks for t in self.tensors), default=0)

    @property
    def page_bytes_per_block(self) -> int:
        """Bytes one block occupies across all tensors (padded pages)."""
        return sum(t.page_size_bytes for t in self.tensors)

    def copied_bytes_per_block(self, group_idx: int) -> int:
        """Bytes one block of group ``group_idx`` moves in a transfer."""
        return sum(ref.page_size_bytes for ref in self.group_data_refs[group_idx])


def as_block_rows(tensor: torch.Tensor) -> torch.Tensor:
    """View a ``(num_blocks, ...)`` tensor as ``(num_blocks, row_bytes)`` int8.

    Each block's elements must be contiguous in memory; the block stride may
    be anything that keeps rows apart (e.g. a K or V slice of a stacked tensor).
    """
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim == 0:
        raise LayoutError("a KV tensor needs a leading num_blocks dimension, got a 0-d tensor")
    t = tensor if tensor.ndim > 1 else tensor.unsqueeze(1)
    if not _block_is_contiguous(t):
        raise LayoutError(
            f"each block's data must be contiguous; shape {tuple(t.shape)} has strides {t.stride()}"
        )
    num_blocks = int(t.shape[0])
    row_bytes = (t.numel() // num_blocks if num_blocks else 0) * t.element_size()
    if num_blocks == 0 or row_bytes == 0:
        raise LayoutError(f"a KV tensor needs at least one non-empty block, got {tuple(t.shape)}")
    stride = t.stride(0) * t.element_size()
    if num_blocks > 1 and stride < row_bytes:
        raise LayoutError(
            f"blocks overlap: shape {tuple(t.shape)} has a block stride of {t.stride(0)} elements"
        )
    # An int8 tensor over the whole storage, then an exact window onto the
    # rows: a view for any element type and any block stride.
    raw = torch.empty(0, dtype=torch.int8, device=t.device).set_(t.untyped_storage())
    offset = t.storage_offset() * t.element_size()
    return raw.as_strided((num_blocks, row_bytes), (stride, 1), offset)


def _block_is_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _split_groups(kv_caches: object) -> list[list[tuple[str, torch.Tensor]]]:
    def layers_of(group: object, where: str) -> list[tuple[str, torch.Tensor]] | None:
        if isinstance(group, Mapping):
            return [(str(k), v) for k, v in group.items()]
        if (
            isinstance(group, Sequence)
            and not isinstance(group, (str, bytes))
            and all(isinstance(t, torch.Tensor) for t in group)
        ):
            return [(f"{where}[{i}]", t) for i, t in enumerate(group)]
        return None

    if isinstance(kv_caches, torch.Tensor):
        raise LayoutError("pass a list or mapping of per-layer tensors, not a single tensor")
    single = layers_of(kv_caches, "layers")
    if single is not None:
        return [single]
    if not isinstance(kv_caches, Sequence):
        raise LayoutError(f"expected a mapping or a list of KV tensors, got {type(kv_caches)}")
    groups = []
    for g, group in enumerate(kv_caches):
        layers = layers_of(group, f"groups[{g}]")
        if layers is None:
            raise LayoutError(
                f"group {g} must be a mapping or a list of tensors, got {type(group).__name__}"
            )
        groups.append(layers)
    return groups


def _split_kv(tensor: torch.Tensor, layout: KVLayout, name: str) -> list[torch.Tensor]:
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"layer {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if layout == "blocks_first":
        return [tensor]
    if tensor.ndim < 2 or tensor.shape[0] != 2:
        raise LayoutError(
            f"layer {name}: kv_first layout needs shape (2, num_blocks, ...), "
            f"got {tuple(tensor.shape)}"
        )
    return [tensor[0], tensor[1]]


def _identity(tensor: torch.Tensor) -> tuple[object, ...]:
    return (
        str(tensor.device),
        tensor.data_ptr(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )
