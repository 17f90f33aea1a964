"""Value translations between vLLM 0.32's offloading types and aiokvo's.

Both sides use the same key layout (block hash + 4-byte big-endian group
index), so keys cross unchanged. Specs differ in dtype (vLLM keeps int32
block ids, aiokvo int64) and events in their medium (vLLM's ``Medium`` enum,
aiokvo's string); the KV caches differ only in class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium
from vllm.v1.kv_offload.base import OffloadingEvent as VllmOffloadingEvent
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPULoadStoreSpec

from aiokvo.errors import TransferSpecError
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec, OffloadingEvent

if TYPE_CHECKING:
    from aiokvo.layout import CanonicalKVCaches

__all__ = [
    "caches_from_vllm",
    "cpu_spec_from_vllm",
    "cpu_spec_to_vllm",
    "event_to_vllm",
    "gpu_spec_from_vllm",
    "lookup_result",
    "tier_place",
]

_MEDIUMS = {"CPU": Medium.CPU}
# A tier below the pool is vLLM's STORAGE medium, told apart by its ownership (vLLM's
# name for "which secondary tier"), and, where vLLM's event has one, its locality.
_TIER_EVENTS: dict[str, tuple[str, str]] = {"DISK": ("disk", "LOCAL"),
                                            "MOONCAKE": ("mooncake", "REMOTE")}
_EVENT_FIELDS = frozenset(getattr(VllmOffloadingEvent, "__dataclass_fields__", ()))


def lookup_result(found: bool | None) -> Any:
    """aiokvo's ``lookup`` answer as vLLM's ``LookupResult``."""
    if found is None:
        return LookupResult.HIT_PENDING
    return LookupResult.HIT if found else LookupResult.MISS


def cpu_spec_to_vllm(spec: LoadStoreSpec) -> Any:
    """An aiokvo CPU spec as vLLM's ``CPULoadStoreSpec`` (chunk ids, int32)."""
    assert isinstance(spec, CPULoadStoreSpec), spec
    out = VllmCPULoadStoreSpec.__new__(VllmCPULoadStoreSpec)
    out.block_ids = spec.block_ids.astype(np.int32)  # the ids are the manager's, < 2**31
    return out


def cpu_spec_from_vllm(spec: Any) -> CPULoadStoreSpec:
    """vLLM's CPU (chunk-id) spec as aiokvo's ``CPULoadStoreSpec``."""
    block_ids = getattr(spec, "block_ids", None)
    if block_ids is None:
        raise TransferSpecError(f"expected vLLM's CPULoadStoreSpec, got {spec!r}")
    return CPULoadStoreSpec(block_ids)


def gpu_spec_from_vllm(spec: Any) -> GPULoadStoreSpec:
    """vLLM's ``GPULoadStoreSpec`` as aiokvo's (same fields, validated)."""
    try:
        block_ids, sizes, indices = spec.block_ids, spec.group_sizes, spec.block_indices
    except AttributeError:
        raise TransferSpecError(f"expected vLLM's GPULoadStoreSpec, got {spec!r}") from None
    return GPULoadStoreSpec(block_ids, sizes, indices)


def tier_place(medium: str) -> tuple[Any, Any]:
    """vLLM's ``(Medium, Locality)`` for an aiokvo tier's medium (``"DISK"``: local
    storage; ``"MOONCAKE"``: remote storage), as 0.33's tier filters match them."""
    _, locality = _TIER_EVENTS.get(medium, ("", "LOCAL"))
    return Medium.STORAGE, Locality[locality]


def event_to_vllm(event: OffloadingEvent) -> Any:
    """An aiokvo event as vLLM's ``OffloadingEvent`` (its ``medium`` a ``Medium``).

    A tier's event (``DISK``, ``MOONCAKE``, or another tier's medium) is vLLM's
    ``Medium.STORAGE`` with ``ownership`` the tier's name in lower case.
    """
    medium = _MEDIUMS.get(event.medium)
    if medium is not None:
        return VllmOffloadingEvent(keys=list(event.keys), medium=medium, removed=event.removed)
    ownership, locality = _TIER_EVENTS.get(event.medium, (event.medium.lower(), "LOCAL"))
    extra: dict[str, Any] = {}
    if "ownership" in _EVENT_FIELDS:
        extra["ownership"] = ownership
    if "locality" in _EVENT_FIELDS:
        extra["locality"] = Locality[locality]
    return VllmOffloadingEvent(
        keys=list(event.keys), medium=Medium.STORAGE, removed=event.removed, **extra
    )


def caches_from_vllm(kv_caches: Any) -> CanonicalKVCaches:
    """vLLM's ``CanonicalKVCaches`` as aiokvo's (views of the same tensors).

    Each vLLM tensor is an int8 ``(num_blocks, page_size_bytes)`` view,
    possibly with a row stride larger than the page (packed layouts);
    aiokvo's canonical tensors take exactly that. vLLM derives a canonical
    page mapping for every ref; aiokvo copies each worker's pages as they
    are, so it is not used (the spec refuses ``canonical_layout``, the one
    setting under which vLLM's own worker would use it).
    """
    from aiokvo.layout import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        as_block_rows,
    )

    tensors = []
    for t in kv_caches.tensors:
        rows = t.tensor if t.tensor.ndim == 2 else as_block_rows(t.tensor)
        tensors.append(CanonicalKVCacheTensor(rows, int(t.page_size_bytes)))
    groups = [
        [CanonicalKVCacheRef(int(ref.tensor_idx), int(ref.page_size_bytes)) for ref in refs]
        for refs in kv_caches.group_data_refs
    ]
    return CanonicalKVCaches(tensors, groups)
