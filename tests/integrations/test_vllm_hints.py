"""aiokvo's schema for vLLM 0.33's ``kv_hints`` actions, without vLLM.

``aiokvo/integrations/vllm/hints.py`` imports no vLLM, but its package does,
so it is loaded by path (as test_vllm_extra_config.py does). The actions go
through vLLM's own ``KvHintsEnvelope`` in tests/integrations/vllm/test_hints.py.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    path = ROOT / "aiokvo" / "integrations" / "vllm" / "hints.py"
    spec = importlib.util.spec_from_file_location("_aiokvo_vllm_hints", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hints = _load()


@dataclass
class Action:
    action_type: Any
    payload: Any
    action_version: Any = "1.0"


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (Action("kv.retain", {"priority": 3, "ttl_s": 30}), hints.Retain(3, 30.0)),
        (Action("kv.retain", {"ttl_s": 0.5}, "1"), hints.Retain(0, 0.5)),
        (Action("kv.prefetch", {"deadline_ms": 250}), hints.Prefetch(0.25)),
        (Action("kv.prefetch", {}), hints.Prefetch(None)),
        (Action("kv.fetch", {"deadline_ms": 0}), hints.Prefetch(0.0)),  # Dynamo's kv.fetch@1.0
        (Action("kv.demote", {}), hints.Demote()),
        (Action("kv.durable", {"tier": "DISK", "timeout_ms": 1500}), hints.Durable("DISK", 1.5)),
        (Action("kv.durable", {}), hints.Durable(None, None)),
    ],
)
def test_each_accepted_action_reads_into_its_call(action: Action, expected: Any) -> None:
    assert hints.read_action(action) == expected


@pytest.mark.parametrize(
    ("action", "reason", "detail"),
    [
        (Action("kv.retain", {"ttl_s": -1}), "bad_payload", "ttl_s"),
        (Action("kv.retain", {"ttl_s": float("nan")}), "bad_payload", "nan"),
        (Action("kv.retain", {"ttl_s": 10, "priority": 1.5}), "bad_payload", "priority"),
        (Action("kv.retain", {"ttl_s": 10, "priority": True}), "bad_payload", "True"),
        (Action("kv.retain", {"ttl_s": 10**9}), "bad_payload", "86400"),
        (Action("kv.retain", {"ttl": 10}), "bad_payload", "['ttl']"),
        (Action("kv.prefetch", {"deadline_ms": "soon"}), "bad_payload", "'soon'"),
        (Action("kv.durable", {"tier": ""}), "bad_payload", "tier"),
        (Action("kv.demote", ["not", "a", "mapping"]), "bad_payload", "mapping"),
        (Action("kv.retain", {"ttl_s": 1}, "2.0"), "unknown_version", "'2.0'"),
        (Action("sglang.pin", {}), "unknown_type", "kv.retain"),
        (Action(None, {}), "unknown_type", "kv.retain"),
    ],
)
def test_a_bad_action_is_refused_with_its_reason_never_raised(
    action: Action, reason: str, detail: str
) -> None:
    refused = hints.read_action(action)
    assert isinstance(refused, hints.Refused)
    assert refused.reason == reason and detail in refused.detail
