"""The stats keys the vLLM manager emits, and their Prometheus metadata.

vLLM's Prometheus logger asserts that every key a manager's ``get_stats``
emits was declared by the spec's ``build_metric_definitions`` (with matching
label names), so both come from here. The names are vLLM's CPU offloading
metrics, with the same meaning, so dashboards built for vLLM's native
offload keep working; aiokvo adds one counter of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

__all__ = [
    "ALLOCATION_SIZE",
    "BREAKER_STATES",
    "CACHE_READ_USAGE",
    "CACHE_USAGE",
    "CACHE_WRITE_USAGE",
    "CONFIG_INFO_KEYS",
    "KV_HINTS_EXECUTED",
    "KV_HINTS_IGNORED",
    "KV_HINTS_INVALID",
    "STORES_SKIPPED",
    "STORE_FAILURES",
    "TIER_BREAKER_STATE",
    "TIER_COUNTERS",
    "TIER_PROMOTIONS_NO_ROOM",
    "TIER_USED_BLOCKS",
    "TIER_WRITES_SKIPPED",
    "metric_definitions",
]

CACHE_USAGE: str = CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
CACHE_WRITE_USAGE: str = CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC
CACHE_READ_USAGE: str = CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC
ALLOCATION_SIZE: str = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
STORES_SKIPPED: str = CPUOffloadingMetrics.STORES_SKIPPED
STORE_FAILURES = "vllm:kv_offload_aiokvo_store_failures"
KV_HINTS_EXECUTED = "vllm:kv_offload_aiokvo_kv_hints_executed"
KV_HINTS_IGNORED = "vllm:kv_offload_aiokvo_kv_hints_ignored"
KV_HINTS_INVALID = "vllm:kv_offload_aiokvo_kv_hints_invalid"

# The tiers below the pool (``aiokvo_tiers``), labelled by medium ("DISK", "MOONCAKE").
TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:kv_offload_aiokvo_tier_lookup_hits": (
        "lookup_hits", "Keys found in a tier below the CPU pool (each then promoted)."),
    "vllm:kv_offload_aiokvo_tier_lookup_misses": (
        "lookup_misses", "Tier lookups that stopped at a key the tier lacks."),
    "vllm:kv_offload_aiokvo_tier_blocks_read": (
        "blocks_read", "Blocks a tier read back good into the CPU pool (promotions)."),
    "vllm:kv_offload_aiokvo_tier_read_failures": (
        "read_failures", "Blocks a tier read did not bring back (I/O, checksum, deadline)."),
    "vllm:kv_offload_aiokvo_tier_checksum_failures": (
        "checksum_failures", "Blocks a tier read back wrong (dropped, never served)."),
    "vllm:kv_offload_aiokvo_tier_blocks_written": (
        "blocks_written", "Blocks written to a tier from the CPU pool (demotions)."),
    "vllm:kv_offload_aiokvo_tier_write_failures": (
        "write_failures", "Blocks a tier write did not commit."),
    "vllm:kv_offload_aiokvo_tier_writes_refused": (
        "writes_refused", "Keys a tier did not write: no room, breaker open, disconnected."),
    "vllm:kv_offload_aiokvo_tier_timeouts": (
        "timeouts", "Tier transfers past their deadline."),
    "vllm:kv_offload_aiokvo_tier_store_failures": (
        "store_failures", "Tier transfers its store failed (the circuit breaker's failures)."),
}  # fmt: skip
"""vLLM stats key -> (``TierStatistics`` field, help): counters, per medium."""
TIER_USED_BLOCKS = "vllm:kv_offload_aiokvo_tier_used_blocks"
TIER_BREAKER_STATE = "vllm:kv_offload_aiokvo_tier_breaker_state"
TIER_PROMOTIONS_NO_ROOM = "vllm:kv_offload_aiokvo_tier_promotions_no_room"
TIER_WRITES_SKIPPED = "vllm:kv_offload_aiokvo_tier_writes_skipped"
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}

CONFIG_INFO_KEYS = (
    "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes", "cpu_kv_cache_size_tokens",
)
"""vLLM 0.33's ``vllm:kv_offload_config_info`` labels for a CPU pool (its ``CPUOffloadingInfo``)."""


def store_threshold(extra_config: Mapping[str, Any]) -> int:
    """``store_threshold`` as vLLM reads it (``int(value)``, default 0)."""
    return int(extra_config.get("store_threshold", 0))


def metric_definitions(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """Every key :class:`~aiokvo.integrations.vllm.manager.AiokvoOffloadingManager` emits."""
    definitions: dict[str, Any] = {
        CACHE_USAGE: OffloadingGaugeMetadata(
            documentation="Fraction of the CPU KV pool held by transfers in flight "
            "(stores being written plus blocks being read)."
        ),
        CACHE_WRITE_USAGE: OffloadingGaugeMetadata(
            documentation="Fraction of the CPU KV pool held by stores in flight."
        ),
        CACHE_READ_USAGE: OffloadingGaugeMetadata(
            documentation="Fraction of the CPU KV pool held by loads in flight."
        ),
        ALLOCATION_SIZE: OffloadingHistogramMetadata(
            documentation="CPU blocks allocated by each KV offload prepare_store call.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
        ),
        STORE_FAILURES: OffloadingCounterMetadata(
            documentation="KV offload stores that failed after aiokvo's retries; "
            "their blocks were dropped, never served."
        ),
        KV_HINTS_EXECUTED: OffloadingCounterMetadata(
            documentation="Orchestrator KV hint actions (vLLM 0.33 kv_hints) aiokvo "
            "carried out (docs/vllm.md, Orchestrator hints)."
        ),
        KV_HINTS_IGNORED: OffloadingCounterMetadata(
            documentation="Well-formed orchestrator KV hint actions aiokvo's spec did not "
            "act on: an unknown type or version, or an action that needs a tier."
        ),
        KV_HINTS_INVALID: OffloadingCounterMetadata(
            documentation="Orchestrator KV hint actions of a known type with a bad payload "
            "(logged once per type and reason)."
        ),
    }
    if extra_config.get("aiokvo_tiers"):
        medium = ("medium",)
        for name, (_, doc) in TIER_COUNTERS.items():
            definitions[name] = OffloadingCounterMetadata(documentation=doc, labelnames=medium)
        definitions[TIER_USED_BLOCKS] = OffloadingGaugeMetadata(
            documentation="Blocks a tier below the CPU pool holds now.", labelnames=medium
        )
        definitions[TIER_BREAKER_STATE] = OffloadingGaugeMetadata(
            documentation="A tier's circuit breaker: 0 closed, 1 half-open, 2 open.",
            labelnames=medium,
        )
        definitions[TIER_PROMOTIONS_NO_ROOM] = OffloadingCounterMetadata(
            documentation="Promotions from a tier not started: no room in the CPU pool."
        )
        definitions[TIER_WRITES_SKIPPED] = OffloadingCounterMetadata(
            documentation="Keys admitted to a tier but not written (its writes in flight "
            "pinned max_write_blocks, or the key left the pool first)."
        )
    if store_threshold(extra_config) >= 2:
        definitions[STORES_SKIPPED] = OffloadingCounterMetadata(
            documentation="KV offload stores skipped because the block was not "
            "offered store_threshold times yet."
        )
    return definitions
