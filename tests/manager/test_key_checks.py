"""Every manager entry point refuses what is not a list of OffloadKeys, changing nothing.

A bare key is ``bytes``, so it iterates as ints: before these checks
``prepare_store(key)`` stored 36 ints and evicted real blocks for them. A key
is ``bytes`` longer than its 4-byte group suffix; anything else is refused
with an :class:`InvalidKeyError` naming it, before any state changes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from aiokvo.errors import InvalidKeyError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.specs import ReqContext

CTX = ReqContext()


def key(i: int) -> OffloadKey:
    return make_offload_key(bytes([i]) * 32, 0)


KEYS = [key(i) for i in range(6)]

Call = Callable[[OffloadingManager, object], object]
ENTRY_POINTS: dict[str, Call] = {
    "lookup_prefix": lambda m, arg: m.lookup_prefix(arg, CTX),  # type: ignore[arg-type]
    "prepare_load": lambda m, arg: m.prepare_load(arg, CTX),  # type: ignore[arg-type]
    "touch": lambda m, arg: m.touch(arg),  # type: ignore[arg-type]
    "complete_load": lambda m, arg: m.complete_load(arg),  # type: ignore[arg-type]
    "prepare_store": lambda m, arg: m.prepare_store(arg, CTX),  # type: ignore[arg-type]
    "complete_store": lambda m, arg: m.complete_store(arg),  # type: ignore[arg-type]
}

NOT_KEYS = [
    pytest.param(7, id="int"),
    pytest.param("a string key longer than four", id="str"),
    pytest.param(b"\x00\x00\x00\x00", id="group-suffix-only"),
    pytest.param(b"ab", id="short-bytes"),
    pytest.param(None, id="None"),
    pytest.param(bytearray(b"x" * 36), id="bytearray"),
    pytest.param(["nested", "list"], id="unhashable"),
]


def build(kind: str) -> tuple[OffloadingManager, CPUOffloadingManager]:
    """A full pool: 0..3 ready (1 pinned by a load), 4 being written."""
    core = CPUOffloadingManager(5, cache_policy="arc" if kind == "arc" else "lru",
                                enable_events=True)
    manager: OffloadingManager = core
    if kind == "reuse":
        manager = FilterReusedOffloadingManager(core, store_threshold=2)
        for k in KEYS * 2:
            manager.lookup(k, CTX)
    out = manager.prepare_store(KEYS[:4], CTX)
    assert out is not None and len(out.keys_to_store) == 4
    manager.complete_store(out.reservation)
    manager.touch(KEYS[2:4])
    manager.prepare_load([KEYS[1]], CTX)
    assert manager.prepare_store([KEYS[4]], CTX) is not None
    manager.take_events()
    return manager, core


def snapshot(manager: OffloadingManager, core: CPUOffloadingManager) -> object:
    counts = dict(manager.counts) if isinstance(manager, FilterReusedOffloadingManager) else {}
    statuses = [core.block_status(k) for k in KEYS]
    return (
        list(core.policy.items()),
        [None if s is None else (s.block_id, s.ref_cnt) for s in statuses],
        core.num_free_blocks,
        counts,
        list(core.take_events()),
    )


MANAGERS = ["lru", "arc", "reuse"]


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_bare_key_is_refused_and_changes_nothing(kind: str, entry: str) -> None:
    manager, core = build(kind)
    before = snapshot(manager, core)
    with pytest.raises(InvalidKeyError, match=rf"{entry} takes a list of keys.*pass \[key\]"):
        ENTRY_POINTS[entry](manager, KEYS[0])
    assert snapshot(manager, core) == before


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("bad", NOT_KEYS)
def test_a_list_with_something_that_is_not_a_key_is_refused(
    kind: str, entry: str, bad: object
) -> None:
    manager, core = build(kind)
    before = snapshot(manager, core)
    # The bad value sits after keys that are held, pinned or free, so that a
    # check done only on the first element, or only on misses, would miss it.
    arg = [KEYS[1], bad] if entry == "complete_load" else [KEYS[0], KEYS[5], bad]
    if entry == "lookup_prefix":
        arg = [KEYS[0], bad, KEYS[5]]
    with pytest.raises(InvalidKeyError, match="is not an OffloadKey") as info:
        ENTRY_POINTS[entry](manager, arg)
    assert entry in str(info.value)
    assert snapshot(manager, core) == before


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("bad", NOT_KEYS)
def test_lookup_refuses_what_is_not_a_key(kind: str, bad: object) -> None:
    manager, core = build(kind)
    before = snapshot(manager, core)
    with pytest.raises(InvalidKeyError, match="lookup"):
        manager.lookup(bad, CTX)  # type: ignore[arg-type]
    assert snapshot(manager, core) == before


@pytest.mark.parametrize("kind", MANAGERS)
def test_other_iterables_of_keys_are_accepted(kind: str) -> None:
    manager, core = build(kind)
    assert manager.lookup_prefix(iter(KEYS[:3]), CTX) == 3
    manager.touch(KEYS[k] for k in (0, 2))
    manager.complete_load({KEYS[1]})
    status = core.block_status(KEYS[1])
    assert status is not None and status.ref_cnt == 0  # its pin was released


def test_a_bytes_subclass_is_a_key() -> None:
    class Key(bytes):
        pass

    m = CPUOffloadingManager(2)
    subclassed = Key(KEYS[0])
    out = m.prepare_store([subclassed], CTX)
    assert out is not None and out.keys_to_store == [KEYS[0]]
    m.complete_store(out.reservation)
    assert m.lookup(KEYS[0], CTX) is True


def test_the_message_names_the_value_and_shows_keys_briefly() -> None:
    m = CPUOffloadingManager(2)
    with pytest.raises(InvalidKeyError) as info:
        m.prepare_store(KEYS[0], CTX)
    message = str(info.value)
    assert "OffloadKey(000000000000…, group 0)" in message
    assert repr(KEYS[0]) not in message
    with pytest.raises(InvalidKeyError, match="'ab'"):
        m.touch([KEYS[0], b"ab"])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_load_errors_show_keys_as_short_hash_and_group(policy: str) -> None:
    from aiokvo.errors import BlockNotReadyError, UnknownKeyError

    m = CPUOffloadingManager(4, cache_policy=policy)
    absent = make_offload_key(bytes(range(32)), 7)
    with pytest.raises(UnknownKeyError) as info:
        m.prepare_load([absent], CTX)
    assert str(info.value) == (
        "cannot load OffloadKey(000102030405…, group 7): it is not offloaded"
    )
    assert m.prepare_store([KEYS[0]], CTX) is not None
    with pytest.raises(BlockNotReadyError, match=r"OffloadKey\(000000000000…, group 0\)"):
        m.prepare_load([KEYS[0]], CTX)
    with pytest.raises(UnknownKeyError, match=r"OffloadKey\(000102030405…, group 7\)"):
        m.complete_load([absent])
    with pytest.raises(BlockNotReadyError, match=r"OffloadKey\(000000000000…, group 0\)"):
        m.complete_load([KEYS[0]])
