"""KV caches shaped like an engine's, for tests (the ``kv_caches`` fixture)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from aiokvo._util import check_choice, check_int
from aiokvo.errors import ConfigError
from aiokvo.layout import CanonicalKVCaches, KVLayout

__all__ = ["KVCaches", "KVCachesFactory", "make_kv_caches"]

_LAYOUTS: tuple[KVLayout, ...] = ("kv_first", "blocks_first")


@dataclass(frozen=True, eq=False)
class KVCaches:
    """Per-layer engine tensors and their canonical (byte-row) view.

    ``layout="kv_first"``: each layer is ``(2, blocks, block_size, kv_heads,
    head_dim)``, FlashAttention's layout in vLLM; ``"blocks_first"``: ``(blocks,
    2, block_size, kv_heads, head_dim)``. :attr:`canonical` is what the
    offloading specs and handlers take.
    """

    tensors: list[torch.Tensor]
    layout: KVLayout
    block_size: int
    canonical: CanonicalKVCaches = field(repr=False)

    @property
    def num_blocks(self) -> int:
        return self.canonical.num_blocks

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        """Layer ``layer``'s K and V data of block ``block_id`` (a view)."""
        t = self.tensors[layer]
        return t[:, block_id] if self.layout == "kv_first" else t[block_id]

    def blocks_equal(self, a: Sequence[int], b: Sequence[int]) -> bool:
        """Whether blocks ``a[i]`` and ``b[i]`` hold the same data in every layer."""
        if len(a) != len(b):
            raise ConfigError(f"compare as many blocks on each side, got {len(a)} and {len(b)}")
        return all(
            torch.equal(self.block(layer, i), self.block(layer, j))
            for layer in range(len(self.tensors))
            for i, j in zip(a, b, strict=True)
        )


class KVCachesFactory(Protocol):
    """The ``kv_caches`` fixture's type: :func:`make_kv_caches`, keywords as there."""

    def __call__(
        self,
        *,
        layers: int = ...,
        blocks: int = ...,
        block_size: int = ...,
        kv_heads: int = ...,
        head_dim: int = ...,
        dtype: torch.dtype = ...,
        device: str | torch.device = ...,
        layout: KVLayout = ...,
        seed: int = ...,
    ) -> KVCaches: ...


def make_kv_caches(
    *,
    layers: int = 2,
    blocks: int = 64,
    block_size: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    layout: KVLayout = "kv_first",
    seed: int = 0,
) -> KVCaches:
    """Random, seeded KV caches of an engine's shape (defaults: one Llama-3-8B block geometry).

    The data is finite (normal samples), so ``torch.equal`` compares blocks
    reliably; every block differs from every other.
    """
    layers = check_int("layers", layers, minimum=1)
    blocks = check_int("blocks", blocks, minimum=1)
    block_size = check_int("block_size", block_size, minimum=1)
    kv_heads = check_int("kv_heads", kv_heads, minimum=1)
    head_dim = check_int("head_dim", head_dim, minimum=1)
    layout = check_choice("layout", layout, _LAYOUTS)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
    per_block = (block_size, kv_heads, head_dim)
    shape = (2, blocks, *per_block) if layout == "kv_first" else (blocks, 2, *per_block)
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)
        for _ in range(layers)
    ]
    return KVCaches(tensors, layout, block_size,
                    CanonicalKVCaches.from_engine(tensors, layout=layout))
