"""vLLM 0.33's orchestrator hints through vLLM's own ``ReqContext`` and ``KvHintsEnvelope``.

A ``kv.retain`` retains the request's blocks when it finishes (evicted after
every other block); actions that need a tier below the pool are counted as
ignored; a bad payload is counted and logged once, never raised.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

kv_hints = pytest.importorskip("vllm.v1.kv_hints", reason="kv_hints came with vLLM 0.33")

from vllm.v1.kv_offload.base import ReqContext as VllmReqContext  # noqa: E402

from aiokvo.integrations.vllm import AiokvoOffloadingSpec  # noqa: E402
from aiokvo.integrations.vllm.metrics import (  # noqa: E402
    KV_HINTS_EXECUTED,
    KV_HINTS_IGNORED,
    KV_HINTS_INVALID,
)
from aiokvo.keys import OffloadKey, make_offload_key  # noqa: E402
from tests.integrations.vllm.test_spec import config  # noqa: E402

BLOCKS = 8
BYTES = 12_000


def keys(prefix: str, n: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}{i}".encode().ljust(32, b"."), 0) for i in range(n)]


def action(kind: str, payload: dict[str, Any], version: str = "1.0") -> Any:
    return kv_hints.KvHintAction(action_id=kind, action_type=kind, action_version=version,
                                 payload=payload)  # fmt: skip


def request(req_id: str, *actions: Any) -> Any:
    hints = None
    if actions:
        hints = kv_hints.KvHintsEnvelope(protocol_version="1", message_id=req_id,
                                         actions=list(actions))  # fmt: skip
    return VllmReqContext(req_id=req_id, kv_hints=hints)


def serve(manager: Any, ctx: Any, ks: list[OffloadKey]) -> None:
    """A request's life as vLLM's scheduler drives it: announced, stored, finished."""
    manager.on_new_request(ctx)
    out = manager.prepare_store(ks, ctx)
    assert out is not None
    manager.complete_store(list(out.keys_to_store), ctx)
    manager.on_request_finished(ctx)


def counters(manager: Any) -> dict[str, float]:
    values = manager.get_stats().data["data"]  # the layout 0.32 and 0.33 share
    return {name: values.get(name, {}).get((), 0)
            for name in (KV_HINTS_EXECUTED, KV_HINTS_IGNORED, KV_HINTS_INVALID)}  # fmt: skip


def test_a_retain_hint_keeps_the_requests_blocks_past_every_other(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = AiokvoOffloadingSpec(config({"cpu_bytes_to_use": BLOCKS * BYTES,
                                        "aiokvo_retention_fraction": 0.5}))  # fmt: skip
    manager = spec.get_manager()
    kept = keys("agent", 2)
    caplog.set_level(logging.WARNING, logger="aiokvo.integrations.vllm")
    serve(manager, request(
        "turn-1",
        action("kv.retain", {"priority": 1, "ttl_s": 600}),
        action("kv.prefetch", {"deadline_ms": 50}, version="1"),  # needs a tier: ignored
        action("kv.retain", {"ttl_s": -1}),  # bad payload: counted, logged once
        action("kv.retain", {"ttl": 5}),  # an unknown field is refused too
        action("sglang.pin", {}),  # not ours: ignored
    ), kept)
    retention = manager.aiokvo_manager.retention
    assert retention is not None and all(k in retention for k in kept)
    for i in range(3):  # 3 x 4 new blocks through a pool of 8: kept outlives them all
        serve(manager, request(f"other-{i}"), keys(f"o{i}-", 4))
    status = manager.aiokvo_manager.block_status
    assert all(status(k) is not None for k in kept)
    assert status(keys("o0-", 1)[0]) is None
    assert counters(manager) == {KV_HINTS_EXECUTED: 1, KV_HINTS_IGNORED: 2, KV_HINTS_INVALID: 2}
    warnings = [r for r in caplog.records if "kv_hints action kv.retain refused" in r.getMessage()]
    assert len(warnings) == 1 and "ttl_s" in warnings[0].getMessage()
    assert counters(manager) == {KV_HINTS_EXECUTED: 0, KV_HINTS_IGNORED: 0, KV_HINTS_INVALID: 0}
    manager.shutdown()


def test_retain_hints_with_retention_off_are_ignored_not_executed() -> None:
    spec = AiokvoOffloadingSpec(config({"cpu_bytes_to_use": BLOCKS * BYTES,
                                        "aiokvo_retention_fraction": "0"}))  # fmt: skip
    manager = spec.get_manager()
    serve(manager, request("r", action("kv.retain", {"ttl_s": 10})), keys("r", 2))
    assert counters(manager) == {KV_HINTS_EXECUTED: 0, KV_HINTS_IGNORED: 1, KV_HINTS_INVALID: 0}
    manager.shutdown()
