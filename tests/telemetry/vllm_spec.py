"""vLLM's KV-event structs, written here from its spec (not imported from aiokvo).

Decoding what aiokvo publishes with these, strictly typed, is the test that
a router built on vLLM's own structs reads it. Field order and struct options
as in ``vllm/distributed/kv_events.py``: map-encoded events since 0.24, the
0.23 array layout for ``encoding="array"``.
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


MAP_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ARRAY_DECODER = msgspec.msgpack.Decoder(OldKVEventBatch)


def external_hash(block_hash: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes on (its default)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
