"""The pure translation of aiokvo events into vLLM KV events, checked byte for byte."""

from __future__ import annotations

import hashlib
import random
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvo.errors import ConfigError, InvalidKeyError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.specs import BlockMetadata, OffloadingEvent, ReqContext
from aiokvo.telemetry.kv_wire import EventBatch, EventTranslator, WireMedium, array_header
from tests.telemetry import vllm_spec as spec

ENCODER = msgspec.msgpack.Encoder()
BARE_CPU = {"CPU": WireMedium("CPU")}  # vLLM's own CPU events carry no locality


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(hashlib.sha256(f"block{i}".encode()).digest(), group)


def block_hash(k: OffloadKey) -> bytes:
    return k[:-4]


def wire(translator: EventTranslator, *events: OffloadingEvent) -> bytes:
    out: list[object] = []
    for event in events:
        translator.translate(event, out)
    return ENCODER.encode(EventBatch(1.5, out, 0))


def decode(translator: EventTranslator, *events: OffloadingEvent) -> spec.KVEventBatch:
    return spec.MAP_DECODER.decode(wire(translator, *events))


def test_a_described_store_is_the_bytes_vllm_sends() -> None:
    # The 141-byte example: one BlockStored of hash 0x1122334455667788, tokens 1..4.
    k = make_offload_key(bytes(24) + bytes.fromhex("1122334455667788"), 0)
    translator = EventTranslator(media=BARE_CPU)
    translator.describe([k], BlockMetadata(token_ids=[1, 2, 3, 4], block_size=4))
    expected = bytes.fromhex(
        "93 cb 3f f8 00 00 00 00 00 00 91 89 a4 74 79 70 65 ab 42 6c 6f 63 6b 53"
        "74 6f 72 65 64 ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73 91 cf 11 22 33 44"
        "55 66 77 88 b1 70 61 72 65 6e 74 5f 62 6c 6f 63 6b 5f 68 61 73 68 c0 a9"
        "74 6f 6b 65 6e 5f 69 64 73 94 01 02 03 04 aa 62 6c 6f 63 6b 5f 73 69 7a"
        "65 04 a7 6c 6f 72 61 5f 69 64 c0 a6 6d 65 64 69 75 6d a3 43 50 55 a9 6c"
        "6f 72 61 5f 6e 61 6d 65 c0 a9 67 72 6f 75 70 5f 69 64 78 00 00"
    )
    assert len(expected) == 141
    assert wire(translator, OffloadingEvent([k], "CPU", False)) == expected


def test_array_encoding_is_the_vllm_0_23_layout() -> None:
    k = make_offload_key(bytes(24) + bytes.fromhex("1122334455667788"), 0)
    translator = EventTranslator(encoding="array")
    translator.describe([k], BlockMetadata(token_ids=[1, 2, 3, 4], block_size=4))
    payload = wire(translator, OffloadingEvent([k], "CPU", False))
    assert payload.hex() == (
        "93cb3ff8000000000000919cab426c6f636b53746f72656491cf1122334455667788c0"
        "940102030404c0a3435055c0c000c0c000"
    )
    removed = spec.ARRAY_DECODER.decode(wire(translator, OffloadingEvent([k], "CPU", True)))
    assert removed.events == [spec.OldBlockRemoved([0x1122334455667788], "CPU", 0)]
    with pytest.raises(msgspec.ValidationError):  # typed map consumers cannot read it
        spec.MAP_DECODER.decode(payload)


def test_placeholders_carry_vllm_hashes_groups_and_medium() -> None:
    keys = [key(0), key(1), key(2, group=1)]
    batch = decode(EventTranslator(), OffloadingEvent(keys, "CPU", False))
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    assert batch.events == [
        spec.BlockStored([spec.external_hash(block_hash(k)) for k in keys[:2]], None, [], 0,
                         None, "CPU", None, group_idx=0, locality="LOCAL"),
        spec.BlockStored([spec.external_hash(block_hash(keys[2]))], None, [], 0, None, "CPU",
                         None, group_idx=1, locality="LOCAL"),
    ]
    # vLLM's example: sha256(b"block0") publishes as 0xe33af5be1d87c12b.
    assert batch.events[0].block_hashes[0] == 0xE33AF5BE1D87C12B


def test_raw_hash_format_publishes_the_block_hash_bytes() -> None:
    k = key(3, group=7)
    batch = decode(EventTranslator(hash_format="bytes"), OffloadingEvent([k], "CPU", True))
    assert batch.events == [spec.BlockRemoved([block_hash(k)], "CPU", 7, "LOCAL")]


def test_removals_group_by_kv_cache_group() -> None:
    keys = [key(0, 0), key(1, 1), key(2, 0)]
    batch = decode(EventTranslator(), OffloadingEvent(keys, "CPU", True))
    assert [(e.group_idx, len(e.block_hashes)) for e in batch.events] == [(0, 2), (1, 1)]
    assert all(isinstance(e, spec.BlockRemoved) for e in batch.events)


def test_described_keys_publish_tokens_parent_and_request_fields() -> None:
    keys = [key(i) for i in range(4)]
    parent = hashlib.sha256(b"before").digest()
    meta = BlockMetadata(
        token_ids=list(range(100, 108)), block_size=2, parent_block_hash=parent,
        lora_id=3, lora_name="adapter", extra_keys=[None, ("salt",), None, None],
        kv_cache_spec_kind="full_attention",
    )
    translator = EventTranslator()
    translator.describe(keys, ReqContext(block_metadata=meta), only=keys[1:])
    assert translator.described == 3
    # keys 1 and 3 stored (2 was already held): two runs, each chained to its parent.
    batch = decode(translator, OffloadingEvent([keys[1], keys[3]], "CPU", False))
    h = [spec.external_hash(block_hash(k)) for k in keys]
    assert batch.events == [
        spec.BlockStored([h[1]], h[0], [102, 103], 2, 3, "CPU", "adapter", [("salt",)], 0,
                         "full_attention", locality="LOCAL"),
        spec.BlockStored([h[3]], h[2], [106, 107], 2, 3, "CPU", "adapter", [None], 0,
                         "full_attention", locality="LOCAL"),
    ]
    assert translator.described == 1  # key 2's entry waits for its own store
    # The first key's parent is the metadata's; a metadata entry is used once.
    translator.describe(keys[:2], meta)
    batch = decode(translator, OffloadingEvent(keys[:2], "CPU", False),
                   OffloadingEvent(keys[:2], "CPU", False))
    assert batch.events[0].block_hashes == h[:2]
    assert batch.events[0].parent_block_hash == spec.external_hash(parent)
    assert batch.events[0].token_ids == list(range(100, 104))
    assert batch.events[1].token_ids == []  # no metadata left: a placeholder


def test_undescribed_keys_between_described_ones_become_placeholders() -> None:
    keys = [key(i) for i in range(3)]
    stranger = key(99)
    translator = EventTranslator()
    translator.describe(keys, BlockMetadata(token_ids=range(6), block_size=2))
    batch = decode(translator, OffloadingEvent([keys[0], stranger, keys[1], keys[2]], "CPU",
                                               False))
    assert [(len(e.block_hashes), e.block_size) for e in batch.events] == [(1, 2), (1, 0), (2, 2)]
    assert batch.events[2].token_ids == [2, 3, 4, 5]


def test_keys_of_several_router_blocks_publish_and_remove_every_block_hash() -> None:
    # Each key covers two router blocks (vLLM's block_size_factor 2).
    blocks = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    keys = [make_offload_key(blocks[1], 0), make_offload_key(blocks[3], 0)]
    meta = BlockMetadata(token_ids=list(range(8)), block_size=2, blocks_per_key=2,
                         block_hashes=blocks)
    translator = EventTranslator()
    translator.describe(keys, meta)
    stored = decode(translator, OffloadingEvent([keys[1]], "CPU", False))
    assert stored.events[0].block_hashes == [spec.external_hash(b) for b in blocks[2:]]
    assert stored.events[0].parent_block_hash == spec.external_hash(blocks[1])
    assert stored.events[0].token_ids == [4, 5, 6, 7] and stored.events[0].block_size == 2
    removed = decode(translator, OffloadingEvent(keys, "CPU", True))
    assert removed.events[0].block_hashes == [
        spec.external_hash(blocks[1]),  # never stored with metadata: the key's own hash
        spec.external_hash(blocks[2]), spec.external_hash(blocks[3]),
    ]


def test_tiers_map_to_vllm_media_with_locality_and_ownership() -> None:
    translator = EventTranslator(media={"NVME": WireMedium("STORAGE", "LOCAL", "nvme")})
    events = [OffloadingEvent([key(0)], medium, True)
              for medium in ("CPU", "GPU", "DISK", "MOONCAKE", "NVME", "Tape")]
    batch = decode(translator, *events)
    assert [(e.medium, e.locality, e.ownership) for e in batch.events] == [
        ("CPU", "LOCAL", None), ("GPU", None, None), ("STORAGE", "LOCAL", "disk"),
        ("STORAGE", "REMOTE", "mooncake"), ("STORAGE", "LOCAL", "nvme"),
        ("STORAGE", None, "tape"),
    ]


def test_all_cleared_in_both_encodings() -> None:
    assert ENCODER.encode(EventTranslator().all_cleared()).hex() == (
        "81a474797065b0416c6c426c6f636b73436c6561726564")
    assert ENCODER.encode(EventTranslator(encoding="array").all_cleared()).hex() == (
        "91b0416c6c426c6f636b73436c6561726564")


def test_the_metadata_table_is_bounded() -> None:
    translator = EventTranslator(max_described=4)
    meta = BlockMetadata(token_ids=range(20), block_size=1)
    for i in range(10):
        translator.describe([key(i)], meta)
    assert translator.described <= 4
    assert translator.described + translator.described_dropped == 10


def test_a_context_without_metadata_describes_nothing() -> None:
    translator = EventTranslator()
    translator.describe([key(0)], ReqContext())
    assert translator.described == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_ids": [1, 2, 3]}, "token_ids has 3 tokens, but 2 keys of 2 tokens need 4"),
        ({"token_ids": list(range(4)), "extra_keys": [None]}, "extra_keys has 1 entries"),
        ({"token_ids": list(range(8)), "blocks_per_key": 2, "block_hashes": [b"x"] * 3},
         "block_hashes has 3 entries, but 2 keys of 2 blocks need 4"),
    ],
)
def test_describe_rejects_metadata_that_does_not_cover_the_keys(
    kwargs: dict[str, object], message: str
) -> None:
    translator = EventTranslator()
    with pytest.raises(ConfigError, match=message):
        translator.describe([key(0), key(1)], BlockMetadata(block_size=2, **kwargs))  # type: ignore[arg-type]
    assert translator.described == 0


def test_describe_rejects_only_keys_outside_the_request() -> None:
    translator = EventTranslator()
    with pytest.raises(ConfigError, match="only names keys that are not in keys"):
        translator.describe([key(0)], BlockMetadata(token_ids=[1], block_size=1),
                            only=[key(1)])
    assert translator.described == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_ids": [1], "block_size": 0}, "block_size must be an int >= 1, got 0"),
        ({"token_ids": "abc", "block_size": 1}, "token_ids must be a sequence of ints"),
        ({"token_ids": [1, 2], "block_size": 1, "blocks_per_key": 2},
         "blocks_per_key=2 needs block_hashes"),
    ],
)
def test_block_metadata_checks_its_fields(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BlockMetadata(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"encoding": "json"}, "encoding must be one of 'map', 'array', got 'json'"),
        ({"hash_format": "hex"}, "hash_format must be one of 'int', 'bytes', got 'hex'"),
        ({"max_described": 1}, "max_described must be an int >= 2, got 1"),
        ({"media": {"CPU": ("CPU", None, None)}}, "media.'CPU'. must be a WireMedium"),
    ],
)
def test_translator_options_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EventTranslator(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("count", [1, 7, 8, 200])
def test_many_keys_in_mixed_groups_publish_the_same_hashes_as_few(count: int) -> None:
    # From 8 keys on, the hashes are read in one vectorised pass; either way
    # each key publishes the last 8 bytes of its hash, grouped by group.
    keys = [key(i, group=i % 3) for i in range(count)]
    for removed in (False, True):
        batch = decode(EventTranslator(), OffloadingEvent(keys, "CPU", removed))
        got = {e.group_idx: e.block_hashes for e in batch.events}
        assert list(got) == sorted({i % 3 for i in range(count)})
        assert got == {g: [ext for i, ext in enumerate(spec.external_hash(block_hash(k))
                                                      for k in keys) if i % 3 == g]
                       for g in got}


@pytest.mark.parametrize("groups", [[5] * 16, [5] * 15 + [6], [6] + [5] * 15, [1 << 24] * 9])
def test_the_one_group_check_tells_every_group_apart(groups: list[int]) -> None:
    # Many keys of one group make one event; one key in another group splits it.
    keys = [key(i, group=g) for i, g in enumerate(groups)]
    batch = decode(EventTranslator(), OffloadingEvent(keys, "CPU", True))
    got = {e.group_idx: len(e.block_hashes) for e in batch.events}
    assert got == {g: groups.count(g) for g in dict.fromkeys(groups)}


def test_keys_of_mixed_or_short_lengths_still_publish_their_hashes() -> None:
    short = [make_offload_key(bytes([i, 1, 2]), 0) for i in range(9)]  # 3-byte hashes
    mixed = [make_offload_key(bytes([i]) * (8 + i), 0) for i in range(9)]
    for keys in (short, mixed, short + mixed):
        (event,) = decode(EventTranslator(), OffloadingEvent(keys, "CPU", True)).events
        assert event.block_hashes == [spec.external_hash(block_hash(k)) for k in keys]


def test_describe_refuses_a_bare_key() -> None:
    """``describe(key, ...)`` would record each byte of the key as a key of its own."""
    k = make_offload_key(b"h" * 8, 0)
    translator = EventTranslator()
    meta = BlockMetadata(token_ids=list(range(4 * len(k))), block_size=4)
    with pytest.raises(InvalidKeyError, match="describe takes a list of keys, got a bare"):
        translator.describe(k, meta)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError, match="describe: 3 is not an OffloadKey"):
        translator.describe([3], meta)  # type: ignore[list-item]
    assert translator.described == 0
    translator.describe((k,), meta)
    assert translator.described == 1


# -- encode(): straight to msgpack, the same bytes as translate() + msgspec ------------


def _random_key(rng: random.Random, hash_len: int, group: int, small: bool) -> OffloadKey:
    digest = bytearray(rng.randbytes(hash_len))
    if small and hash_len >= 8:
        digest[-8:-4] = bytes(4)  # a hash below 2**32: msgpack writes it shorter
    return make_offload_key(bytes(digest), group)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), encoding=st.sampled_from(["map", "array"]),
       hash_format=st.sampled_from(["int", "bytes"]), describe=st.booleans())
def test_encode_writes_exactly_what_msgspec_writes_for_the_translated_events(
    seed: int, encoding: str, hash_format: str, describe: bool
) -> None:
    """Placeholders and removals take the numpy path; several groups in one event, short
    and mixed-length keys, small hashes, described stores and fanned-out removals take
    translate(): either way the bytes are msgspec's, event for event."""
    rng = random.Random(seed)
    fast = EventTranslator(encoding=encoding, hash_format=hash_format)  # type: ignore[arg-type]
    slow = EventTranslator(encoding=encoding, hash_format=hash_format)  # type: ignore[arg-type]
    items: list[object] = []
    for _ in range(rng.randrange(1, 12)):
        n = rng.choice([1, 3, 8, 20, 70, 150, 400])
        hash_len = rng.choice([32, 32, 32, 16, 6])
        groups = [rng.choice([0, 0, 0, 1, 7])] * n if rng.random() < 0.8 else [
            rng.randrange(3) for _ in range(n)]
        keys = [_random_key(rng, hash_len, g, rng.random() < 0.05) for g in groups]
        if rng.random() < 0.1:
            keys.append(_random_key(rng, 40, groups[0], False))  # a key of another length
        removed = rng.random() < 0.4
        if describe and not removed and rng.random() < 0.5 and len(set(groups)) == 1:
            meta = BlockMetadata(token_ids=list(range(4 * len(keys))), block_size=4)
            fast.describe(keys, meta)
            slow.describe(keys, meta)
        items.append(OffloadingEvent(keys, rng.choice(["CPU", "DISK", "MOONCAKE"]), removed))
        if rng.random() < 0.1:
            items.append(fast.all_cleared())
    parts: list[bytes] = []
    count = fast.encode(items, parts)  # type: ignore[arg-type]
    expected: list[object] = []
    for item in items:
        if isinstance(item, msgspec.Struct):
            expected.append(item)
        else:
            slow.translate(item, expected)  # type: ignore[arg-type]
    assert count == len(expected)
    assert b"".join(parts) == b"".join(ENCODER.encode(e) for e in expected)
    assert fast.described == slow.described


def test_encode_takes_the_numpy_path_for_a_large_plain_batch() -> None:
    """(So the property test above compares the two paths, not one with itself.)"""
    translator = EventTranslator()
    events = [OffloadingEvent([key(i) for i in range(j * 100, j * 100 + 100)], "CPU", j % 2 == 1)
              for j in range(4)]
    parts: list[bytes] = []
    assert translator.encode(events, parts) == 4
    assert len(translator._templates) == 2  # one frame per kind, medium and group
    structs: list[object] = []
    for event in events:
        translator.translate(event, structs)
    assert parts == [ENCODER.encode(s) for s in structs]  # one part per event


def test_the_publishers_batches_are_msgspecs_event_batches() -> None:
    """The publisher writes the batch frame around the encoded events itself."""
    from aiokvo.telemetry.kv_writer import _batch_frame

    translator = EventTranslator()
    events = [OffloadingEvent([key(i) for i in range(30)], "CPU", False)]
    for rank in (0, 3, None):
        head, tail = _batch_frame(rank)
        parts: list[bytes] = []
        count = translator.encode(events, parts)
        payload = head + struct.pack(">d", 1.25) + array_header(count) + b"".join(parts) + tail
        structs: list[object] = []
        translator.translate(events[0], structs)
        assert payload == ENCODER.encode(EventBatch(1.25, structs, rank))
