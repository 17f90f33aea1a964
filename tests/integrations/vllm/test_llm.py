"""A whole ``vllm.LLM`` engine (vLLM's CPU build) with aiokvo's spec.

Each engine runs in a process of its own, on vLLM's multiprocess executor
(the scheduler in the engine-core process, the model runner and aiokvo's
worker in a worker process): see ``engine.py`` for the model and the
workload. Needs the CPU build (0.32); vLLM 0.33 has none (docs/vllm.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.engine import (
    AIOKVO,
    FAILING,
    Run,
    Workload,
    run_in_subprocess,
    write_tiny_llama,
)

pytestmark = [pytest.mark.system, pytest.mark.vllm_llm]  # a whole vllm.LLM on the CPU build

WORKLOAD = Workload(docs=12, prefix_tokens=512, requests=120, round_size=12)
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
STORE_FAILURES = "vllm:kv_offload_aiokvo_store_failures"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def baseline(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same engine and workload without offloading."""
    return run_in_subprocess(Run(model=str(llama), workload=WORKLOAD, probes=True),
                             tmp_path_factory.mktemp("baseline"))


def test_the_output_depends_on_the_prefix_kv(baseline: dict[str, Any]) -> None:
    """Without this, token identity below would prove nothing (dummy weights)."""
    probes = baseline["probes"]
    for a, other_prefix, first_token_changed in zip(probes[0::3], probes[1::3], probes[2::3],
                                                    strict=True):
        assert a != other_prefix
        assert a != first_token_changed  # the KV of the first block matters
    assert len({tuple(t) for t in baseline["tokens"]}) > len(baseline["tokens"]) // 2
    assert baseline["metrics"].get(EXTERNAL_HITS, 0) == 0


def test_the_engine_gives_the_same_tokens_with_aiokvo_and_loads_from_its_pool(
    llama: Path, baseline: dict[str, Any], tmp_path: Path
) -> None:
    got = run_in_subprocess(Run(model=str(llama), workload=WORKLOAD, spec=dict(AIOKVO)),
                            tmp_path)
    assert got["tokens"] == baseline["tokens"]
    metrics = got["metrics"]
    assert metrics[EXTERNAL_HITS] > WORKLOAD.requests * WORKLOAD.prefix_tokens // 4
    assert metrics["vllm:kv_offload_load_bytes"] > 0
    assert metrics["vllm:kv_offload_store_bytes"] > 0
    assert metrics[STORE_FAILURES] == 0


def test_stores_failed_in_the_worker_process_are_never_served(
    llama: Path, baseline: dict[str, Any], tmp_path: Path
) -> None:
    """Every store copy fails in the worker process; the manager, in the engine-core
    process, must drop those keys: no external hit, and the same tokens."""
    got = run_in_subprocess(
        Run(model=str(llama), workload=WORKLOAD, spec=dict(FAILING),
            extra_config={"fail_copies": "store", "aiokvo_retries": 1}),
        tmp_path,
    )  # fmt: skip
    metrics = got["metrics"]
    assert metrics[STORE_FAILURES] > 0
    assert metrics.get(EXTERNAL_HITS, 0) == 0
    assert got["tokens"] == baseline["tokens"]
    assert "failed after retries" in got["log"]  # the worker said so, in its process


TIER_READ = "vllm:kv_offload_aiokvo_tier_blocks_read"
TIER_WRITTEN = "vllm:kv_offload_aiokvo_tier_blocks_written"


def test_a_restarted_engine_keeps_its_prefix_cache_on_disk(
    llama: Path, baseline: dict[str, Any], tmp_path: Path
) -> None:
    """Engine one serves the workload with a disk tier and exits; engine two, a new
    process on the same root, loads its first requests' prefixes from the disk."""
    tiers = {"aiokvo_tiers": [{"kind": "disk", "root": str(tmp_path / "kv"),
                               "capacity_bytes": 64 << 20, "fsync": "none"}]}
    one = run_in_subprocess(Run(model=str(llama), workload=WORKLOAD, spec=dict(AIOKVO),
                                extra_config=tiers), tmp_path / "one")
    assert one["tokens"] == baseline["tokens"]
    first = one["metrics"]
    assert first[TIER_WRITTEN] >= WORKLOAD.docs * WORKLOAD.prefix_tokens // 32
    assert first.get(TIER_READ, 0) == 0  # the CPU pool held everything
    two = run_in_subprocess(Run(model=str(llama), workload=WORKLOAD, spec=dict(AIOKVO),
                                extra_config=tiers), tmp_path / "two")
    assert two["tokens"] == baseline["tokens"]
    metrics = two["metrics"]
    assert metrics[TIER_READ] >= WORKLOAD.docs * WORKLOAD.prefix_tokens // 32
    assert metrics.get("vllm:kv_offload_aiokvo_tier_read_failures", 0) == 0
    # Its first round (one request per prefix, nothing in its GPU cache or CPU pool
    # yet): every request's prefix came from the disk.
    first_round = two["cached_tokens"][: WORKLOAD.round_size]
    assert all(n >= WORKLOAD.prefix_tokens - 32 for n in first_round), first_round
    assert one["cached_tokens"][: WORKLOAD.round_size] == [0] * WORKLOAD.round_size
