"""pytest plugin: vLLM's own manager and connector tests (0.32, 0.33), run against aiokvo.

Loaded with ``-p aiokvo_vllm_suite`` (this directory on ``PYTHONPATH``: vLLM's
``tests`` package must win the name) when pytest
runs inside vLLM's unpacked source distribution (``tests/`` only; the
installed CPU build is the ``vllm`` imported). It

* swaps vLLM's ``CPUOffloadingManager`` for :class:`AiokvoCPUOffloadingManager`
  (same constructor, aiokvo's decisions behind the integration's manager) in
  every test module that builds a real manager;
* deselects the tests listed in :data:`VLLM_INTERNALS`, which read or patch
  vLLM's private structures (``manager._policy``, ARC's ``ChunkStatus``
  objects, ``_allocate_chunks``, out-of-tree vLLM policies) rather than the
  manager's contract, printing each with its reason;
* marks every test ``skip_global_cleanup``: vLLM's autouse cleanup touches
  ``torch.accelerator``, which raises on a CPU-only machine.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from vllm.v1.kv_offload.base import Medium

from aiokvo.integrations.vllm.failures import StoreFailures
from aiokvo.integrations.vllm.manager import AiokvoOffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies import ARCCachePolicy, LRUCachePolicy
from aiokvo.manager.reuse import FilterReusedOffloadingManager

SWAPPED_MODULES = (
    "tests.v1.kv_offload.cpu.test_manager",
    "tests.v1.kv_connector.unit.offloading_connector.test_scheduler",
)

_POLICY = "inspects vLLM's policy objects (manager._policy, ChunkStatus, t1/t2 internals)"
VLLM_INTERNALS: dict[str, str] = {}
"""Test name (as pytest prints it, without parameters) -> why it is deselected; filled below."""


def _internal(reason: str, *names: str) -> None:
    for name in names:
        VLLM_INTERNALS[name] = reason


_internal(_POLICY, "test_lru_batch_eviction_failure_is_atomic",
          "test_lru_repeated_pin_cycles_compact_lazy_heap_entries",
          "test_reset_discards_stale_request_access_classification",
          "test_arc_pending_chunk_is_not_a_frequency_hit")
_internal("calls vLLM's policy API directly (evict(n, protected) over ChunkStatus entries)",
          "test_batch_eviction_scans_t1_and_t2_once",
          "test_batch_eviction_falls_back_after_t1_iterator_exhausted")
_internal("swaps the policy's T1/T2 dicts for counting ones (aiokvo's manager probes its "
          "policy's own dicts)", "test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction")
_internal("reads vLLM's private counters (stores_skipped_in_current_batch, "
          "_num_evictable_cache_chunks)", "test_store_threshold_does_not_hide_ready_reuse",
          "test_evictable_cache_chunk_count")
_internal("monkeypatches vLLM's private methods (_allocate_chunks, "
          "_record_request_cache_access)",
          "test_cpu_manager_reports_allocation_size_on_allocation_failure",
          "test_failed_store_records_access_once_and_uses_store_miss_hook")
_internal("monkeypatches vLLM's policy hooks, whose signatures are vLLM's (touch(keys, ctx), "
          "on_request_finished(key_groups, ..., ctx))", "test_touch_forwards_req_context_to_policy",
          "test_request_finish_forwards_grouped_deduplicated_accesses")


_LRU_033 = ("vLLM 0.33's LRU rule (a running request's blocks share one provisional rank, "
            "ordered by token position), which aiokvo does not follow (docs/vllm.md)")
VLLM_033_LRU = (
    "test_unfinished_lru_prefix_survives_pressure_across_store_batches",
    "test_unfinished_lru_reused_prefix_outlives_new_tail",
    "test_unfinished_lru_backfill_orders_by_token_position",
    "test_lru_failed_store_retry_preserves_prefix_order",
    "test_lru_incremental_stores_do_not_rescan_the_prefix",
    "test_lru_insert_orders_positioned_chunks_without_followup_access",
)
"""vLLM 0.33's tests of its new LRU rule (they are not in 0.32's suite)."""
_internal(_LRU_033, *VLLM_033_LRU)


class AiokvoCPUOffloadingManager(AiokvoOffloadingManager):
    """vLLM's ``CPUOffloadingManager`` constructor, aiokvo's manager behind it."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
    ) -> None:
        if cache_policy_module_path is not None:
            raise pytest.UsageError("out-of-tree vLLM policies have no aiokvo equivalent")
        core = CPUOffloadingManager(
            num_chunks, cache_policy, enable_events=enable_events, recency="request"
        )
        manager: Any = core
        if store_threshold >= 2:
            manager = FilterReusedOffloadingManager(
                core, store_threshold, max_tracker_size, counting="offers"
            )
        config_info = info.as_config_info() if info is not None else None  # vLLM 0.33
        super().__init__(manager, StoreFailures(), config_info=config_info,
                         enable_events=enable_events)
        # What vLLM's tests read off vLLM's manager, answered by aiokvo's parts:
        # the medium, and the policy (aiokvo's ARC has the same t1/t2/b1/b2
        # lists and target; its entries are block ids, not ChunkStatus objects).
        self.medium = Medium.CPU
        self._policy = core.policy
        self.counts = manager.counts if store_threshold >= 2 else None  # the offer tracker


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for name in SWAPPED_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "CPUOffloadingManager"):
            module.CPUOffloadingManager = AiokvoCPUOffloadingManager
            # isinstance checks on the policy name aiokvo's classes then.
            policies = {"ARCCachePolicy": ARCCachePolicy, "LRUCachePolicy": LRUCachePolicy}
            for name, cls in policies.items():
                if hasattr(module, name):
                    setattr(module, name, cls)
    kept, dropped = [], []
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)
        base = item.name.split("[", 1)[0]
        cls = getattr(item, "cls", None)
        # A whole class can be internal: TestARCPolicy pokes at ARC's lists.
        reason = VLLM_INTERNALS.get(base) or VLLM_INTERNALS.get(cls.__name__ if cls else "")
        (dropped if reason else kept).append((item, reason))
    if dropped:
        config.hook.pytest_deselected(items=[item for item, _ in dropped])
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        for item, reason in dropped:
            if reporter is not None:
                reporter.write_line(f"deselected (vLLM internals: {reason}): {item.nodeid}")
    items[:] = [item for item, _ in kept]
