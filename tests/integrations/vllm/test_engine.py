"""vLLM 0.32's real scheduler and OffloadingConnector, both roles, running on aiokvo.

Configured only through ``kv_connector_extra_config``; every load is checked
byte for byte against the fake model (see ``harness``).
"""

from __future__ import annotations

from typing import Any

import pytest

from aiokvo.errors import TransferError
from aiokvo.integrations.vllm import AiokvoOffloadingManager, AiokvoOffloadingWorker
from tests.integrations.vllm.harness import (
    AIOKVO_SPEC,
    FAILING_SPEC,
    FAKE_CUDA_SPEC,
    SLOW_SPEC,
    Harness,
    run_scenario,
)

pytestmark = pytest.mark.system  # vLLM's real engine loop

STORE_FAILURES = "vllm:kv_offload_aiokvo_store_failures"


def check_common(h: Harness, out: dict[str, Any], bpc: int) -> None:
    assert isinstance(h.manager, AiokvoOffloadingManager)
    assert isinstance(h.worker, AiokvoOffloadingWorker)
    assert out["reloads"] == 4  # every prefix came back from the CPU pool
    assert out["preemptions"] > 0 and out["reloads_after_preemption"] == 1
    assert out["loads_right_after_reset"] == 0  # reset_cache: nothing served from before
    assert out["loads_after_restore"] == 1
    assert h.loads_checked >= 8 and not h.pending_load_checks
    assert h.attend_checks > 1000
    if bpc > 1:
        assert h.partial_chunk_loads > 0
    assert h.calls["touch"] == 0  # vLLM 0.32 never touches: recency is per request
    assert h.calls["on_request_finished"] > 0
    assert h.threads == {"MainThread"}
    assert h.stats_counters["vllm:kv_offload_store_bytes"] > 0
    assert h.stats_counters["vllm:kv_offload_load_bytes"] > 0
    assert h.stats_counters[STORE_FAILURES] == 0
    stats = h.worker.statistics()
    assert stats.stores > 0 and stats.loads == h.loads_checked
    assert (stats.stores_failed, stats.loads_failed, stats.in_flight) == (0, 0, 0)


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_the_engine_runs_on_aiokvo(harness_factory: Any, scheduler: str, policy: str,
                                   bpc: int) -> None:
    h = harness_factory(spec=dict(AIOKVO_SPEC), scheduler=scheduler, policy=policy,
                        blocks_per_chunk=bpc)
    out = run_scenario(h)
    check_common(h, out, bpc)
    assert out["cpu_blocks_after_stores"] > 0 and out["cpu_blocks_final"] > 0


@pytest.mark.parametrize(("scheduler", "policy"), [("sync", "lru"), ("async", "arc")])
def test_stores_in_flight_give_hit_pending_and_flush_fences(
    harness_factory: Any, scheduler: str, policy: str
) -> None:
    # Each copy lasts three engine steps, not 30 ms: on a loaded machine the steps
    # slow down too, and a store timed in seconds was done before its blocks came back.
    h = harness_factory(spec=dict(SLOW_SPEC), scheduler=scheduler, policy=policy,
                        extra={"slow_copy_steps": 3})
    out = run_scenario(h)
    check_common(h, out, 1)
    assert out["hit_pending"] > 0  # a prefix looked up while its store was in flight
    assert h.flushes > 0  # blocks reallocated under a store in flight were flushed first


def test_the_cuda_handler_on_the_fake_driver(harness_factory: Any) -> None:
    h = harness_factory(spec=dict(FAKE_CUDA_SPEC), policy="arc", blocks_per_chunk=2)
    out = run_scenario(h)
    check_common(h, out, 2)


def test_failed_stores_are_dropped_and_never_served(harness_factory: Any) -> None:
    h = harness_factory(spec=dict(FAILING_SPEC), extra={"fail_copies": "store"})
    out = run_scenario(h)
    stats = h.worker.statistics()
    assert stats.stores_failed > 0 and stats.retried == 2 * stats.stores_failed
    assert h.stats_counters[STORE_FAILURES] > 0
    assert h.loads_checked == 0 and out["reloads"] == 0  # nothing was ever readable
    assert len(h.manager.aiokvo_manager) == 0


def test_a_load_that_fails_once_is_retried_and_right(harness_factory: Any) -> None:
    h = harness_factory(spec=dict(FAILING_SPEC), extra={"fail_copies": "load", "fail_first": 2})
    out = run_scenario(h)
    check_common(h, out, 1)  # the retried load was checked byte for byte
    assert h.worker.statistics().retried == 2


def test_a_load_that_keeps_failing_is_reported_or_raised(harness_factory: Any) -> None:
    h = harness_factory(spec=dict(FAILING_SPEC), extra={"fail_copies": "load"},
                        check_loads=False, check_attended=False)
    # The engine goes on (vLLM 0.32 cannot be told); the GPU blocks of those
    # loads hold whatever was there, so the data checks are off here.
    run_scenario(h)
    stats = h.worker.statistics()
    assert stats.loads_failed == stats.loads > 0
    strict = harness_factory(
        spec=dict(FAILING_SPEC),
        extra={"fail_copies": "load", "aiokvo_on_load_failure": "raise"},
        check_loads=False, check_attended=False,
    )
    with pytest.raises(TransferError, match="load job"):
        run_scenario(strict)
