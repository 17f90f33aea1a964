"""The CPU pool of a handler pair: its row geometry, or a shared region's views.

**Tail room.** A private pool may give every row ``row_tail_bytes`` of room
after its KV bytes (:func:`padded_row_stride`): the pool tensors stay
``(num_blocks, row bytes)`` views, so no copy, checksum or tier ever sees
the room as KV bytes, but a tier that owns it (the Mooncake tier's trailer)
can send a row and its room as one buffer. The stride is rounded up to a
page when the rows are whole pages (a disk tier keeps O_DIRECT), else to
64 bytes.

**Regions.** With a shared region (one region per engine), each canonical
KV tensor gets one
:meth:`~aiokvo.memory.shared_region.SharedOffloadRegion.create_next_view`
slice of this rank's part of every row: a ``(num_blocks, page_size_bytes *
block_size_factor)`` int8 tensor whose row stride spans every tensor and
every rank (no tail room: the bytes after a row are another tensor's or
rank's). Both backends copy to and from such strided rows. The region is
borrowed: the pair drops its views when it closes, and whoever opened the
region closes it afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiokvo._util import check_int
from aiokvo.errors import ConfigError, SharedRegionLayoutError
from aiokvo.layout import CanonicalKVCaches

if TYPE_CHECKING:
    import torch

    from aiokvo.memory.shared_region import SharedOffloadRegion

__all__ = ["padded_row_stride", "region_pool"]

_PAGE = 4096
_LINE = 64


def padded_row_stride(width: int, tail: int) -> int:
    """The row stride of a pool of ``width``-byte rows with ``tail`` bytes of room
    after each (``width`` itself for no room)."""
    width = check_int("row width", width, minimum=0)
    tail = check_int("row_tail_bytes", tail, minimum=0)
    if not tail:
        return width
    unit = _PAGE if width and width % _PAGE == 0 else _LINE
    return -(-(width + tail) // unit) * unit


def region_pool(
    kv_caches: CanonicalKVCaches,
    region: SharedOffloadRegion,
    *,
    block_size_factor: int,
    num_cpu_blocks: int,
) -> tuple[torch.Tensor, ...]:
    """One view of ``region`` per canonical tensor of ``kv_caches``, in order.

    Checked before any view is taken: ``region`` is an open
    :class:`~aiokvo.memory.shared_region.SharedOffloadRegion` with a rank,
    it has ``num_cpu_blocks`` rows, and this rank's slice has room for every
    tensor's ``page_size_bytes * block_size_factor`` bytes.
    """
    from aiokvo.memory.shared_region import SharedOffloadRegion

    factor = check_int("block_size_factor", block_size_factor, minimum=1)
    num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, minimum=1)
    if not isinstance(region, SharedOffloadRegion):
        raise ConfigError(f"region must be a SharedOffloadRegion, got {region!r}")
    if region.closed or region.rank is None:
        state = "closed" if region.closed else "opened without a rank"
        raise ConfigError(f"the CPU pool needs an open region with a rank, {region!r} is {state}")
    if region.num_blocks != num_cpu_blocks:
        raise ConfigError(
            f"num_cpu_blocks={num_cpu_blocks} but region {region.path} has "
            f"{region.num_blocks} rows (one per offloaded block)"
        )
    widths = [t.page_size_bytes * factor for t in kv_caches.tensors]
    if sum(widths) > region.page_bytes_per_rank:
        raise SharedRegionLayoutError(
            f"the KV caches need {sum(widths)} bytes per offloaded block on each rank "
            f"({len(widths)} tensors x block_size_factor {factor}), but region "
            f"{region.path} gives each rank {region.page_bytes_per_rank}"
        )
    return tuple(region.create_next_view(width) for width in widths)
