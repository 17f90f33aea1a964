"""``LayoutFingerprint``: what must match for a tier's blocks to be this engine's bytes.

A tier stores raw rows of the CPU pool. Read back by an engine with another
model, dtype, page geometry, block size, group layout or rank, they would be
well-formed and wrong. So every tier namespaces its blocks by this
fingerprint: a disk tier names its directory after :meth:`name` and keeps the
full :meth:`digest` in every file header it writes, and a file whose header
disagrees is a miss. ``FORMAT_VERSION`` is part of it, so a new on-disk
format never reads an old one. Pure: plain data, no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from aiokvo._util import check_int, check_text
from aiokvo.errors import ConfigError

if TYPE_CHECKING:
    from aiokvo.config import OffloadConfig
    from aiokvo.layout import CanonicalKVCaches

__all__ = ["FORMAT_VERSION", "LayoutFingerprint"]

FORMAT_VERSION = 1
"""The tiers' block format version; bumping it changes every fingerprint."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutFingerprint:
    """The layout facts a tier's block depends on.

    * ``model_id``, ``dtype``: what the bytes mean (names given by the engine);
    * ``tensor_row_bytes``: bytes of one offloaded block in each canonical
      KV tensor (its page size times ``block_size_factor``), in tensor order;
    * ``group_refs``: per KV-cache group, ``(tensor index, page bytes)`` of
      each of its layers, so the group layout itself is part of it;
    * ``block_tokens``: tokens per offloaded block of each group, and
      ``block_size_factor`` GPU blocks per offloaded block;
    * ``rank`` of ``world_size`` (each rank holds its own slice of a block);
    * ``format_version``.
    """

    model_id: str
    dtype: str
    tensor_row_bytes: tuple[int, ...]
    group_refs: tuple[tuple[tuple[int, int], ...], ...]
    block_tokens: tuple[int, ...]
    block_size_factor: int
    rank: int
    world_size: int
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        check_text("model_id", self.model_id)
        check_text("dtype", self.dtype)
        if not self.tensor_row_bytes or not self.group_refs:
            raise ConfigError("a layout fingerprint needs at least one tensor and one group")
        for group in self.group_refs:
            for tensor_idx, _ in group:
                check_int("tensor index", tensor_idx, minimum=0,
                          maximum=len(self.tensor_row_bytes) - 1)  # fmt: skip
        if len(self.block_tokens) != len(self.group_refs):
            raise ConfigError(
                f"block_tokens has {len(self.block_tokens)} entries for "
                f"{len(self.group_refs)} groups"
            )
        check_int("rank", self.rank, minimum=0, maximum=self.world_size - 1)

    @classmethod
    def of(
        cls,
        kv_caches: CanonicalKVCaches,
        config: OffloadConfig,
        *,
        model_id: str,
        dtype: str,
    ) -> LayoutFingerprint:
        """The fingerprint of ``kv_caches`` offloaded as ``config`` says."""
        factor = config.block_size_factor
        return cls(
            model_id=model_id,
            dtype=dtype,
            tensor_row_bytes=tuple(t.page_size_bytes * factor for t in kv_caches.tensors),
            group_refs=tuple(
                tuple((r.tensor_idx, r.page_size_bytes) for r in refs)
                for refs in kv_caches.group_data_refs
            ),
            block_tokens=tuple(size * factor for size in config.gpu_block_sizes),
            block_size_factor=factor,
            rank=config.rank,
            world_size=config.world_size,
        )

    def group_tensors(self, group: int) -> tuple[int, ...]:
        """The canonical tensors group ``group`` uses, each once, in order."""
        return tuple(dict.fromkeys(t for t, _ in self.group_refs[group]))

    def payload_bytes(self, group: int) -> int:
        """Bytes a block of ``group`` holds: a full row of each of its tensors."""
        return sum(self.tensor_row_bytes[t] for t in self.group_tensors(group))

    def canonical(self) -> bytes:
        """The encoding the digest is taken over (sorted JSON, no whitespace)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """SHA-256 of :meth:`canonical`: 32 bytes, kept in file headers."""
        return hashlib.sha256(self.canonical()).digest()

    def name(self) -> str:
        """A directory name for this layout: ``v<format>-<first 16 digest bytes, hex>``."""
        return f"v{self.format_version}-{self.digest()[:16].hex()}"
