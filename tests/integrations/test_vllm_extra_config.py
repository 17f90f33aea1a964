"""The vLLM spec's ``kv_connector_extra_config`` checks, without vLLM.

``aiokvo/integrations/vllm/extra_config.py`` imports no vLLM, but its
package does (the spec subclasses vLLM's), so it is loaded here by path.
With vLLM (``make test-vllm``), tests/integrations/vllm/test_spec.py checks
that the spec calls it before anything else.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from aiokvo.config import UnknownConfigKeyWarning
from aiokvo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    path = ROOT / "aiokvo" / "integrations" / "vllm" / "extra_config.py"
    spec = importlib.util.spec_from_file_location("_aiokvo_vllm_extra_config", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


extra_config = _load()
check = extra_config.check_extra_config
GOOD = {"spec_name": "AiokvoOffloadingSpec", "spec_module_path": "aiokvo.integrations.vllm",
        "cpu_bytes_to_use": 1 << 30}


def test_a_good_config_passes_and_its_numbers_are_read() -> None:
    extra = {**GOOD, "cpu_bytes_to_use": "1073741824", "store_threshold": "2",
             "max_tracker_size": 1e4, "eviction_policy": "arc", "offload_prompt_only": True,
             "aiokvo_loop": "thread", "aiokvo_retries": 3, "aiokvo_on_load_failure": "raise",
             "aiokvo_handler_options": {"copy_threads": 4, "poller_mode": "adaptive",
                                        "engine": "kernel", "timing": False}}
    checked = check(extra)
    assert (checked["cpu_bytes_to_use"], checked["store_threshold"]) == (1 << 30, 2)
    assert checked["max_tracker_size"] == 10_000
    assert extra["cpu_bytes_to_use"] == "1073741824"  # the caller's mapping is not changed


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"store_threshold": "two"}, "'store_threshold'] must be an integer"),
        ({"store_threshold": -1}, "'store_threshold'] must be an integer 0.."),  # was silently 0
        ({"store_threshold": 2.5}, "'store_threshold'] must be an integer"),  # was silently 2
        ({"store_threshold": True}, "'store_threshold'] must be an integer"),
        ({"max_tracker_size": 0}, "'max_tracker_size'] must be an integer 1.."),
        ({"cpu_bytes_to_use": None}, "'cpu_bytes_to_use'] must be given"),
        ({"cpu_bytes_to_use": 0}, "'cpu_bytes_to_use'] must be an integer 1.."),
        ({"cpu_bytes_to_use": "lots"}, "'cpu_bytes_to_use'] must be an integer"),
        ({"cpu_bytes_to_use": 1 << 62}, "'cpu_bytes_to_use'] must be an integer 1.."),
        ({"blocks_per_chunk": 0}, "'blocks_per_chunk'] must be an integer"),
        ({"offload_prompt_only": "false"}, "'offload_prompt_only'] must be true or false"),
        ({"self_describing_kv_events": 1}, "'self_describing_kv_events'] must be true or false"),
        ({"eviction_policy": "lfu"}, "'eviction_policy']: unknown cache policy 'lfu'"),
        ({"eviction_policy": ""}, "'eviction_policy'] must be a non-empty string"),
        ({"spec_module_path": 3}, "'spec_module_path'] must be a non-empty string"),
        ({"aiokvo_loop": "fast"}, "aiokvo_loop must be one of"),
        ({"aiokvo_retries": -1}, "'aiokvo_retries'] must be an integer 0..100"),
        ({"aiokvo_on_load_failure": "ignore"}, "aiokvo_on_load_failure must be one of"),
        ({"aiokvo_loops": "pump"}, "unknown aiokvo keys ['aiokvo_loops']"),
        ({"canonical_layout": True}, "'canonical_layout'] is not supported"),
        ({"cache_policy_module_path": "pkg.Policy"}, "'cache_policy_module_path'] names a vLLM"),
        ({"aiokvo_handler_options": 3}, "'aiokvo_handler_options'] must be a mapping"),
        ({"aiokvo_handler_options": {"copy_thread": 4}},
         "['copy_thread'] = 4: not a handler option; known: "),
        ({"aiokvo_handler_options": {"copy_threads": 0}}, "copy_threads must be an int >= 1"),
        ({"aiokvo_handler_options": {"poller_mode": "fast"}}, "poller_mode must be one of"),
        ({"aiokvo_handler_options": {"engine": "gpu"}}, "engine must be one of"),
        ({"aiokvo_handler_options": {"timing": "yes"}}, "timing must be true or false"),
        ({"aiokvo_handler_options": {"inline_after": -1}}, "inline_after must be None or"),
        ({"aiokvo_handler_options": {"copy_fn": "memcpy"}}, "copy_fn must be a function"),
        ({"aiokvo_handler_options": {"driver": None}}, "['driver'] = None: set by the spec"),
    ],
)
def test_every_key_is_checked_up_front_naming_key_and_value(
    changes: dict[str, Any], named: str
) -> None:
    extra = {**GOOD, **changes}
    with pytest.raises(ConfigError) as info:
        check(extra)
    message = str(info.value)
    assert named in message
    ((_, value),) = changes.items()
    if isinstance(value, dict):
        ((_, value),) = value.items()
    if value is not None:
        assert repr(value) in message or str(value) in message, message


@pytest.mark.parametrize("extra", [None, [("cpu_bytes_to_use", 1)], "cpu_bytes_to_use=1"])
def test_something_that_is_not_a_mapping_is_refused(extra: object) -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config must be a mapping"):
        check(extra)


def test_keys_nobody_reads_warn_or_with_strict_fail() -> None:
    with pytest.warns(UnknownConfigKeyWarning, match="'evict_policy'"):
        check({**GOOD, "evict_policy": "arc"})
    with pytest.raises(ConfigError, match="'evict_policy'"):
        check({**GOOD, "evict_policy": "arc"}, strict=True)


def test_the_handler_options_are_the_handlers_own_arguments() -> None:
    """Every keyword the host and CUDA handlers (and the CUDA pair) take is an option, or
    set by the spec: a new argument cannot be forgotten here."""
    from aiokvo.handlers.cuda.handler import CudaOffloadingHandler
    from aiokvo.handlers.cuda.pair import make_cuda_handlers
    from aiokvo.handlers.host.handler import HostOffloadingHandler

    taken: set[str] = set()
    for function in (HostOffloadingHandler.__init__, CudaOffloadingHandler.__init__,
                     make_cuda_handlers):
        taken |= {name for name, p in inspect.signature(function).parameters.items()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert taken == set(extra_config.HANDLER_OPTIONS) | (
        extra_config.SPEC_SET_OPTIONS & taken
    )
    assert not set(extra_config.HANDLER_OPTIONS) & extra_config.SPEC_SET_OPTIONS


def test_the_vllm_docs_config_passes() -> None:
    """docs/vllm.md's kv_connector_extra_config (its block runs whole in the vLLM venv)."""
    from tests.docs.blocks import blocks

    (block,) = [b for b in blocks()
                if b.page == "docs/vllm.md" and "KVTransferConfig(" in b.code]
    call = ast.parse(block.code).body[-1]
    assert isinstance(call, ast.Assign) and isinstance(call.value, ast.Call)
    (keyword,) = [k for k in call.value.keywords if k.arg == "kv_connector_extra_config"]
    extra = eval(compile(ast.Expression(keyword.value), "docs/vllm.md", "eval"))  # a literal
    assert check(extra)["cpu_bytes_to_use"] == 8 << 30


def test_the_vllm_docs_tier_config_passes(tmp_path: Path) -> None:
    """docs/vllm.md's ``aiokvo_tiers`` example: one disk tier, read as from_dict reads it."""
    from tests.docs.blocks import blocks

    tier_configs = extra_config.tier_configs

    (block,) = [b for b in blocks() if b.page == "docs/vllm.md" and "aiokvo_tiers" in b.code]
    (assign,) = ast.parse(block.code).body
    assert isinstance(assign, ast.Assign)
    extra = eval(compile(ast.Expression(assign.value), "docs/vllm.md", "eval"))  # a literal
    extra["aiokvo_tiers"][0]["root"] = str(tmp_path)
    assert check(extra)["aiokvo_tiers"] == extra["aiokvo_tiers"]
    (tier,) = tier_configs(extra["aiokvo_tiers"], model_id="llama")
    assert (tier.kind, tier.root, tier.model_id) == ("disk", str(tmp_path), "llama")
    assert tier.capacity_bytes == 200 << 30
    with pytest.raises(ConfigError, match=r"aiokvo_tiers'\]\[0\]"):
        tier_configs([{"kind": "disk", "root": str(tmp_path), "capacity_bytes": -1}],
                     model_id="llama")
    with pytest.raises(ConfigError, match="twice"):
        tier_configs([extra["aiokvo_tiers"][0]] * 2, model_id="llama")
