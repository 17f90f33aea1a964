"""An out-of-tree cache policy, plugged in by module path.

The policy below lives in a module written to a temporary directory, as a
third-party package would, and is written naively against the
``CachePolicy`` interface: it evicts the most recently stored idle block
first (MRU), which no built-in policy does, so the manager's decisions show
that it really is in charge. The manager must keep its own guarantees
(block ids, pins, protection, all-or-nothing) whatever the policy is.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from aiokvo.errors import UnknownPolicyError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies.base import CachePolicy
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, ReqContext

CTX = ReqContext()
MODULE = "aiokvo_test_plugin_policies"

PLUGIN_SOURCE = '''
from collections import OrderedDict

from aiokvo.manager.policies.base import CachePolicy


class MRUPolicy(CachePolicy):
    """Evicts the most recently stored (or touched) idle block first."""

    created = []

    def __init__(self, cache_capacity):
        super().__init__(cache_capacity)
        self.blocks = OrderedDict()
        self.touches = []
        MRUPolicy.created.append(self)

    def get(self, key):
        return self.blocks.get(key)

    def __contains__(self, key):
        return key in self.blocks

    def __len__(self):
        return len(self.blocks)

    def items(self):
        return iter(list(reversed(self.blocks.items())))

    def insert(self, keys, block_ids):
        for key, block_id in zip(keys, block_ids, strict=True):
            self.blocks[key] = block_id

    def remove(self, keys):
        for key in keys:
            del self.blocks[key]

    def touch(self, keys, writing):
        self.touches.append([(key, key in writing) for key in keys])
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n, exclude):
        victims = [
            key for key in reversed(self.blocks)
            if not any(key in container for container in exclude)
        ][:n]
        if len(victims) < n:
            return None
        return victims, [self.blocks.pop(key) for key in victims]


class NotAPolicy:
    def __init__(self, cache_capacity):
        pass
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """Write the plugin module outside the source tree and make it importable."""
    directory: Path = tmp_path_factory.mktemp("plugins")
    (directory / f"{MODULE}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    sys.path.insert(0, str(directory))
    try:
        module = __import__(MODULE)
        yield module
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop(MODULE, None)


def k(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


a, b, c, d, e = (k(n) for n in "abcde")


def ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids.tolist()]


def put(m: CPUOffloadingManager, *keys: OffloadKey) -> tuple[list[int], list[OffloadKey]]:
    out = m.prepare_store(list(keys), CTX)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return ids(out.store_spec), out.evicted_keys


@pytest.mark.parametrize("path", [f"{MODULE}:MRUPolicy", f"{MODULE}.MRUPolicy"])
def test_policy_loaded_by_module_path_makes_the_decisions(plugin: ModuleType, path: str) -> None:
    m = CPUOffloadingManager(3, cache_policy=path)
    assert isinstance(plugin.MRUPolicy.created[-1], CachePolicy)
    assert plugin.MRUPolicy.created[-1].cache_capacity == 3
    assert put(m, a, b, c) == ([0, 1, 2], [])
    assert put(m, d) == ([2], [c])  # most recently stored goes first
    m.touch([a])
    assert put(m, e) == ([0], [a])


def test_policy_class_can_be_passed_directly(plugin: ModuleType) -> None:
    m = CPUOffloadingManager(2, cache_policy=plugin.MRUPolicy)
    put(m, a, b)
    assert put(m, c) == ([1], [b])


def test_manager_still_protects_pinned_written_and_named_blocks(plugin: ModuleType) -> None:
    m = CPUOffloadingManager(4, cache_policy=f"{MODULE}:MRUPolicy")
    put(m, a, b)
    m.prepare_load([b], CTX)
    assert m.prepare_store([c, d], CTX) is not None  # c, d being written
    out = m.prepare_store([a, e], CTX)  # a is named by the call, b is read
    assert out is None
    assert [m.lookup(key, CTX) for key in (a, b, c, d, e)] == [True, True, None, None, False]
    m.complete_load([b])
    out = m.prepare_store([a, e], CTX)
    assert out is not None
    assert (out.keys_to_store, ids(out.store_spec), out.evicted_keys) == ([e], [1], [b])


def test_policy_is_told_which_touched_blocks_are_being_written(plugin: ModuleType) -> None:
    m = CPUOffloadingManager(3, cache_policy=f"{MODULE}:MRUPolicy")
    put(m, a)
    assert m.prepare_store([b], CTX) is not None
    m.touch([a, b, c])
    policy = plugin.MRUPolicy.created[-1]
    assert policy.touches == [[(a, False), (b, True), (c, False)]]


def test_block_ids_and_failed_stores_are_the_managers_business(plugin: ModuleType) -> None:
    m = CPUOffloadingManager(3, cache_policy=f"{MODULE}:MRUPolicy")
    out = m.prepare_store([a, b, c], CTX)
    assert out is not None and ids(out.store_spec) == [0, 1, 2]
    m.complete_store([a, b, c], success=False)
    assert len(plugin.MRUPolicy.created[-1]) == 0
    assert put(m, d, e) == ([2, 1], [])


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("aiokvo_no_such_module:Policy", "aiokvo_no_such_module"),
        (f"{MODULE}:NoSuchPolicy", "NoSuchPolicy"),
        (f"{MODULE}:NotAPolicy", "NotAPolicy"),
        ("mru", "mru"),
        ("", "''"),
    ],
)
def test_bad_policy_paths_are_named_in_the_error(plugin: ModuleType, path: str, named: str) -> None:
    with pytest.raises(UnknownPolicyError, match=named):
        CPUOffloadingManager(2, cache_policy=path)


def test_a_class_that_is_not_a_policy_is_rejected(plugin: ModuleType) -> None:
    with pytest.raises(UnknownPolicyError, match="NotAPolicy"):
        CPUOffloadingManager(2, cache_policy=plugin.NotAPolicy)
