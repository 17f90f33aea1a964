"""vLLM's KV-event wire format, and the translation of aiokvo's events into it.

Pure and synchronous (the sans-I/O half of :mod:`aiokvo.telemetry.kv_events`):
no sockets, no asyncio. The structs follow ``vllm/distributed/kv_events.py``
field for field and option for option, so that ``msgspec`` encodes exactly
what vLLM's ``ZmqEventPublisher`` sends:

* a batch is a positional array ``[ts, events, data_parallel_rank]``;
* ``encoding="map"`` (vLLM >= 0.24): each event a map tagged ``"type"``, keys
  in declaration order, optional fields left out when unset;
* ``encoding="array"`` (vLLM <= 0.23): each event a positional array, the tag
  first, then every field of the 0.23 field set (no ``locality`` and no
  ``ownership``: such consumers tell tiers apart by ``medium`` only).

Media use vLLM's names. aiokvo's media map to ``(medium, locality, ownership)``
by :data:`DEFAULT_MEDIA`: the CPU pool is ``"CPU"``, local, primary; the
coming disk and Mooncake tiers are ``"STORAGE"``, told apart by ``locality``
(``"LOCAL"`` / ``"REMOTE"``) and ``ownership`` (the tier's name, as vLLM's
secondary tiers set it). An unknown medium is published as ``"STORAGE"``
owned by its own lower-cased name, never dropped.

Block hashes are vLLM's 64-bit ints by default: the last 8 bytes of the
block hash, unsigned big-endian (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``,
what llm-d and Dynamo read); the key's group goes into ``group_idx``.
``hash_format="bytes"`` publishes the raw hash instead.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, Protocol, TypeAlias

import msgspec
import numpy as np

from aiokvo._util import check_choice, check_int
from aiokvo.errors import ConfigError
from aiokvo.keys import GROUP_IDX_BYTES, OffloadKey, check_keys, key_sequence
from aiokvo.specs import BlockMetadata, ReqContext

__all__ = [
    "DEFAULT_MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "ArrayAllBlocksCleared",
    "ArrayBlockRemoved",
    "ArrayBlockStored",
    "BlockRemoved",
    "BlockStored",
    "Description",
    "Encoding",
    "EventBatch",
    "EventLike",
    "EventTranslator",
    "HashFormat",
    "WireMedium",
    "array_header",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

Encoding = Literal["map", "array"]
HashFormat = Literal["int", "bytes"]
_ENCODINGS: tuple[Encoding, ...] = ("map", "array")
_HASH_FORMATS: tuple[HashFormat, ...] = ("int", "bytes")

Hash: TypeAlias = int | bytes


class WireMedium(NamedTuple):
    """How one aiokvo medium is named in KV events."""

    medium: str
    locality: str | None = None
    ownership: str | None = None


DEFAULT_MEDIA: Mapping[str, WireMedium] = MappingProxyType(
    {
        "GPU": WireMedium(MEDIUM_GPU),
        "CPU": WireMedium(MEDIUM_CPU, "LOCAL"),
        "DISK": WireMedium(MEDIUM_STORAGE, "LOCAL", "disk"),
        "MOONCAKE": WireMedium(MEDIUM_STORAGE, "REMOTE", "mooncake"),
    }
)
"""aiokvo medium -> (vLLM medium, locality, ownership); see the module docstring."""


# -- the structs (map-encoded events, vLLM >= 0.24) ------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publish: ``[ts, events, data_parallel_rank]`` (always three elements)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    """Blocks became readable on ``medium``; ``token_ids`` empty means a placeholder."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    pass


# -- the structs (array-encoded events, vLLM <= 0.23) ----------------------------


class _ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(_ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(_ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(_ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


# -- translation -----------------------------------------------------------------


class EventLike(Protocol):
    """What the translator reads of an event (``aiokvo.specs.OffloadingEvent``)."""

    @property
    def keys(self) -> Sequence[OffloadKey]: ...

    @property
    def medium(self) -> str: ...

    @property
    def removed(self) -> bool: ...


class _Described:
    """A request's keys and their :class:`BlockMetadata`, shared by every key's entry."""

    __slots__ = ("keys", "metadata")

    def __init__(self, keys: Sequence[OffloadKey], metadata: BlockMetadata) -> None:
        self.keys = keys
        self.metadata = metadata


class Description(NamedTuple):
    """A checked :meth:`EventTranslator.describe` call, to be recorded later."""

    keys: Sequence[OffloadKey]
    """The keys whose next store event it describes."""
    entry: _Described


class _Generations:
    """A bounded key -> value table: two generations, the older dropped whole.

    O(1) inserts and pops with no per-entry bookkeeping (deleting from the
    front of a plain dict makes iteration from the front quadratic); an
    entry survives at least ``capacity // 2`` newer inserts.
    """

    __slots__ = ("_half", "_old", "_young", "dropped")

    def __init__(self, capacity: int) -> None:
        self._half = max(1, capacity // 2)
        self._young: dict[OffloadKey, Any] = {}
        self._old: dict[OffloadKey, Any] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def put_many(self, keys: Iterable[OffloadKey], value: Any) -> None:
        self._young.update(zip(keys, itertools.repeat(value)))
        self._rotate()

    def put(self, key: OffloadKey, value: Any) -> None:
        self._young[key] = value
        if len(self._young) > self._half:
            self._rotate()

    def _rotate(self) -> None:
        if len(self._young) > self._half:
            self.dropped += len(self._old)
            self._old, self._young = self._young, {}

    def pop(self, key: OffloadKey) -> Any:
        value = self._young.pop(key, None)
        if value is None and self._old:
            value = self._old.pop(key, None)
        return value

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()


def _too_short(name: str, values: Sequence[object], keys: int, per_key: int) -> ConfigError:
    return ConfigError(f"{name} has {len(values)} entries, but {keys} keys of "
                       f"{per_key} blocks need {keys * per_key}")


def _group_of(key: OffloadKey) -> int:
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def _int_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def _key_int_hash(key: OffloadKey) -> int:
    # key = block hash + 4 group bytes; [-12:-4] is the hash's last <= 8 bytes.
    return int.from_bytes(key[-12:-4], "big")


def _key_raw_hash(key: OffloadKey) -> bytes:
    return key[:-GROUP_IDX_BYTES]


def _raw_hash(block_hash: bytes) -> bytes:
    return bytes(block_hash)


class EventTranslator:
    """Turns aiokvo events into vLLM KV events; remembers what callers described.

    ``describe`` records, per key, the request metadata a ``BlockStored`` of
    that key should carry. The table is bounded (``max_described`` keys, the
    oldest generation dropped whole); an entry is used once, by the key's
    next store. Keys nobody described are published as vLLM publishes its own
    offload events by default: placeholders (``token_ids=[]``,
    ``block_size=0``), which routers that already know the hash (from the
    engine's GPU events) read as "now also on this tier".
    """

    __slots__ = (
        "_block_hash",
        "_cleared",
        "_described",
        "_encoder",
        "_fanout",
        "_key_hash",
        "_media",
        "_removed_cls",
        "_stored_cls",
        "_templates",
        "encoding",
        "hash_format",
    )

    def __init__(
        self,
        *,
        encoding: Encoding = "map",
        hash_format: HashFormat = "int",
        media: Mapping[str, WireMedium] | None = None,
        max_described: int = 65_536,
    ) -> None:
        self.encoding: Encoding = check_choice("encoding", encoding, _ENCODINGS)
        self.hash_format: HashFormat = check_choice("hash_format", hash_format, _HASH_FORMATS)
        max_described = check_int("max_described", max_described, minimum=2)
        table = dict(DEFAULT_MEDIA)
        for name, wire in (media or {}).items():
            if not isinstance(wire, WireMedium):
                raise ConfigError(f"media[{name!r}] must be a WireMedium, got {wire!r}")
            table[name] = wire
        self._media = table
        self._key_hash: Callable[[OffloadKey], Hash]
        self._block_hash: Callable[[bytes], Hash]
        if hash_format == "int":
            self._key_hash, self._block_hash = _key_int_hash, _int_hash
        else:
            self._key_hash, self._block_hash = _key_raw_hash, _raw_hash
        self._stored_cls: type[BlockStored] | type[ArrayBlockStored]
        self._removed_cls: type[BlockRemoved] | type[ArrayBlockRemoved]
        self._cleared: AllBlocksCleared | ArrayAllBlocksCleared
        if encoding == "map":
            self._stored_cls, self._removed_cls = BlockStored, BlockRemoved
            self._cleared = AllBlocksCleared()
        else:
            self._stored_cls, self._removed_cls = ArrayBlockStored, ArrayBlockRemoved
            self._cleared = ArrayAllBlocksCleared()
        self._described = _Generations(max_described)
        # Keys stored with several router blocks each: the hashes their removal fans out to.
        self._fanout = _Generations(max_described)
        self._encoder = msgspec.msgpack.Encoder()
        self._templates: dict[tuple[bool, str, int], tuple[bytes, bytes]] = {}

    # -- metadata ------------------------------------------------------------------

    def describe(
        self,
        keys: Sequence[OffloadKey],
        context: ReqContext | BlockMetadata,
        *,
        only: Collection[OffloadKey] | None = None,
    ) -> None:
        """Remember what the next ``BlockStored`` of each of ``keys`` carries.

        ``keys`` are the request's keys in order from its first block (what
        ``lookup_prefix`` and ``prepare_store`` are given); ``context``
        carries a :class:`BlockMetadata` for them, directly or as
        ``ReqContext.block_metadata`` (a context without one is ignored).
        ``only`` limits the entries to the keys about to be stored
        (``prepare_store(...).keys_to_store``), which keeps the table to the
        blocks that will be published. Raises :class:`ConfigError` if the
        metadata does not cover the keys, before recording anything.
        """
        prepared = self.prepare_description(keys, context, only=only)
        if prepared is not None:
            self.record_description(prepared)

    def prepare_description(
        self,
        keys: Sequence[OffloadKey],
        context: ReqContext | BlockMetadata,
        *,
        only: Collection[OffloadKey] | None = None,
    ) -> Description | None:
        """:meth:`describe`'s checks, and what it would record, without recording it.

        For a caller that records it later, in order with the events (the
        publisher's writer thread); None when ``context`` carries no metadata.
        """
        keys = key_sequence(keys, "describe")  # a bare key iterates as ints
        check_keys(keys, "describe")
        metadata = context.block_metadata if isinstance(context, ReqContext) else context
        if metadata is None:
            return None
        if not isinstance(metadata, BlockMetadata):
            raise ConfigError(f"context must carry a BlockMetadata, got {metadata!r}")
        count = len(keys)
        per_key = metadata.blocks_per_key
        if len(metadata.token_ids) < count * per_key * metadata.block_size:
            raise ConfigError(
                f"token_ids has {len(metadata.token_ids)} tokens, but {count} keys of "
                f"{metadata.tokens_per_key} tokens need {count * metadata.tokens_per_key}"
            )
        blocks = count * per_key
        if metadata.block_hashes is not None and len(metadata.block_hashes) < blocks:
            raise _too_short("block_hashes", metadata.block_hashes, count, per_key)
        if metadata.extra_keys is not None and len(metadata.extra_keys) < blocks:
            raise _too_short("extra_keys", metadata.extra_keys, count, per_key)
        if only is not None:
            missing = set(only).difference(keys)
            if missing:
                raise ConfigError(f"only names keys that are not in keys: {sorted(missing)!r}")
        return Description(keys if only is None else tuple(only), _Described(keys, metadata))

    def record_description(self, description: Description) -> None:
        """Record what :meth:`prepare_description` returned (one table insert per key)."""
        self._described.put_many(description.keys, description.entry)

    @property
    def described(self) -> int:
        """Keys with metadata waiting for their store event."""
        return len(self._described)

    @property
    def described_dropped(self) -> int:
        """Described keys forgotten unused (the table is bounded)."""
        return self._described.dropped

    # -- events --------------------------------------------------------------------

    def all_cleared(self) -> AllBlocksCleared | ArrayAllBlocksCleared:
        """An ``AllBlocksCleared`` event in this translator's encoding."""
        return self._cleared

    def wire_medium(self, medium: str) -> WireMedium:
        wire = self._media.get(medium)
        if wire is None:
            wire = self._media[medium] = WireMedium(MEDIUM_STORAGE, None, medium.lower())
        return wire

    def translate(self, event: EventLike, out: list[Any]) -> None:
        """Append the KV events ``event`` stands for to ``out``."""
        keys = event.keys
        if not keys:
            return
        wire = self.wire_medium(event.medium)
        if event.removed:
            self._removed(keys, wire, out)
        elif len(self._described) == 0:
            self._placeholders(keys, wire, out)
        else:
            self._stored(keys, wire, out)

    def _columns(self, keys: Sequence[OffloadKey]) -> tuple[list[Hash], int | list[int]]:
        """Every key's published hash, and its group: one int when all share it.

        Many keys (an eviction, a long prefix) are read as one numpy record
        array, 4x faster than a loop over the keys; the loop is kept for a
        few keys, mixed key lengths and raw hashes.
        """
        if self.hash_format == "int" and len(keys) >= _VECTOR_MIN:
            dtype = _record_dtype(len(keys[0]))
            if dtype is not None and len(set(map(len, keys))) == 1:
                records = np.frombuffer(b"".join(keys), dtype=dtype)
                groups = records["group"]
                hashes: list[Hash] = records["hash"].tolist()
                # One group for all (the usual case): a bytes comparison, 4x
                # cheaper than (groups == groups[0]).all() at these sizes.
                packed = groups.tobytes()
                if packed == packed[:GROUP_IDX_BYTES] * len(groups):
                    return hashes, int(groups[0])
                return hashes, groups.tolist()
        key_hash = self._key_hash
        hashes = [key_hash(k) for k in keys]
        first = keys[0][-GROUP_IDX_BYTES:]
        if all(key.endswith(first) for key in keys):
            return hashes, _group_of(keys[0])
        return hashes, [_group_of(k) for k in keys]

    def _groups(self, keys: Sequence[OffloadKey]) -> Iterable[tuple[int, list[Hash]]]:
        """The keys' hashes split by KV-cache group, in first-appearance order."""
        hashes, groups = self._columns(keys)
        if isinstance(groups, int):
            return ((groups, hashes),)
        by_group: dict[int, list[Hash]] = {}
        for group, h in zip(groups, hashes, strict=True):
            by_group.setdefault(group, []).append(h)
        return by_group.items()

    def _placeholders(
        self, keys: Sequence[OffloadKey], wire: WireMedium, out: list[Any]
    ) -> None:
        for group, hashes in self._groups(keys):
            out.append(self._store_event(
                hashes, None, [], 0, None, None, None, group, None, None, wire,
            ))

    def _stored(self, keys: Sequence[OffloadKey], wire: WireMedium, out: list[Any]) -> None:
        described = self._described
        bare: list[OffloadKey] = []
        run: _Described | None = None
        start = end = 0
        for key in keys:
            entry: _Described | None = described.pop(key)
            if entry is not None:
                if entry is run and end < len(entry.keys) and entry.keys[end] == key:
                    end += 1
                    continue
                try:
                    index = entry.keys.index(key)
                except ValueError:  # pragma: no cover - describe() checked it
                    entry = None
            if run is not None:
                self._described_event(run, start, end, wire, out)
                run = None
            if entry is None:
                bare.append(key)
                continue
            if bare:
                self._placeholders(bare, wire, out)
                bare = []
            run, start, end = entry, index, index + 1
        if run is not None:
            self._described_event(run, start, end, wire, out)
        if bare:
            self._placeholders(bare, wire, out)

    def _described_event(
        self, entry: _Described, start: int, end: int, wire: WireMedium, out: list[Any]
    ) -> None:
        """One ``BlockStored`` for keys ``start:end`` of a described request."""
        meta, keys = entry.metadata, entry.keys
        per_key, n = meta.blocks_per_key, meta.tokens_per_key
        block_hash = self._block_hash
        if meta.block_hashes is not None:
            source = meta.block_hashes
            hashes = [block_hash(h) for h in source[start * per_key : end * per_key]]
            parent_raw = source[start * per_key - 1] if start else meta.parent_block_hash
            parent = block_hash(parent_raw) if parent_raw is not None else None
            if per_key > 1:
                fanout = self._fanout
                for i in range(start, end):
                    fanout.put(keys[i], hashes[(i - start) * per_key : (i - start + 1) * per_key])
        else:
            key_hash = self._key_hash
            hashes = [key_hash(k) for k in keys[start:end]]
            if start:
                parent = key_hash(keys[start - 1])
            elif meta.parent_block_hash is not None:
                parent = block_hash(meta.parent_block_hash)
            else:
                parent = None
        extra = meta.extra_keys
        out.append(self._store_event(
            hashes, parent, meta.token_ids[start * n : end * n], meta.block_size,
            meta.lora_id, meta.lora_name,
            list(extra[start * per_key : end * per_key]) if extra is not None else None,
            _group_of(keys[start]), meta.kv_cache_spec_kind,
            meta.kv_cache_spec_sliding_window, wire,
        ))

    def _store_event(
        self, hashes: list[Any], parent: Hash | None, tokens: Sequence[int], block_size: int,
        lora_id: int | None, lora_name: str | None, extra_keys: list[Any] | None, group: int,
        spec_kind: str | None, sliding_window: int | None, wire: WireMedium,
    ) -> BlockStored | ArrayBlockStored:
        if self._stored_cls is BlockStored:
            return BlockStored(
                hashes, parent, tokens, block_size, lora_id, wire.medium, lora_name,
                extra_keys, group, spec_kind, sliding_window, wire.locality, wire.ownership,
            )
        return ArrayBlockStored(
            hashes, parent, tokens, block_size, lora_id, wire.medium, lora_name,
            extra_keys, group, spec_kind, sliding_window,
        )

    def _removed(self, keys: Sequence[OffloadKey], wire: WireMedium, out: list[Any]) -> None:
        fanout = self._fanout
        if len(fanout):
            # Keys stored with several router blocks each remove all of them.
            key_hash = self._key_hash
            expanded: dict[int, list[Hash]] = {}
            for key in keys:
                fanned = fanout.pop(key)
                hashes = expanded.setdefault(_group_of(key), [])
                if fanned is None:
                    hashes.append(key_hash(key))
                else:
                    hashes.extend(fanned)
            groups: Iterable[tuple[int, list[Hash]]] = expanded.items()
        else:
            groups = self._groups(keys)
        for group, hashes in groups:
            if self._removed_cls is BlockRemoved:
                out.append(BlockRemoved(hashes, wire.medium, group, wire.locality, wire.ownership))
            else:
                out.append(ArrayBlockRemoved(hashes, wire.medium, group))


    # -- straight to msgpack ----------------------------------------------------------

    def encode(self, items: Sequence[EventLike | msgspec.Struct], out: list[bytes]) -> int:
        """Append the KV events ``items`` stand for to ``out``, msgpack-encoded; how many.

        ``b"".join(out)`` is the events' encodings back to back (a part may hold
        several events).

        The same bytes as encoding :meth:`translate`'s structs one by one
        (msgpack concatenates), made faster for the common case, a batch of
        placeholder stores and removals: every key's hash is already the wire's
        ``uint64`` (``0xcf`` + the hash's last 8 bytes, big-endian), so one
        numpy pass over all the batch's keys writes them all, and each event is
        its kind's bytes around its slice (templates msgspec made, per kind,
        medium and group). A small batch (under 300 keys, where numpy's fixed
        costs lose), or one with anything else (ready structs such as
        ``all_cleared()``, described stores, fanned-out removals, raw hashes,
        short or mixed-length keys) takes :meth:`translate` and msgspec, and
        so does an event whose keys span groups or hold a hash below 2**32
        (which msgpack writes shorter).
        """
        wire = self._wire_hashes(items)
        if wire is None:
            return self._encode_slowly(items, out)
        blob, bounds, small, group = wire
        templates = self._templates
        count = pos = 0
        for item in items:
            keys = item.keys  # type: ignore[union-attr]
            n = len(keys)
            stop = pos + n
            if (bounds and _crosses(bounds, pos, stop)) or (
                small and _crosses(small, pos - 1, stop)
            ):
                count += self._encode_slowly((item,), out)
            else:
                g = group if isinstance(group, int) else group[pos]
                key = (item.removed, item.medium, g)  # type: ignore[union-attr]
                frame = templates.get(key) or self._template(*key)
                out.append(frame[0] + array_header(n) + blob[pos * 9 : stop * 9] + frame[1])
                count += 1
            pos = stop
        return count

    def _encode_slowly(self, items: Iterable[EventLike | msgspec.Struct], out: list[bytes]) -> int:
        """:meth:`translate` and one msgspec call for all of ``items`` (its list header cut)."""
        structs: list[Any] = []
        for item in items:
            if isinstance(item, msgspec.Struct):
                structs.append(item)
            else:
                self.translate(item, structs)
        if structs:
            encoded = self._encoder.encode(structs)
            out.append(encoded[len(array_header(len(structs))) :])
        return len(structs)

    def _wire_hashes(
        self, items: Sequence[EventLike | msgspec.Struct]
    ) -> tuple[bytes, list[int], list[int], int | list[int]] | None:
        """For a batch the fast path can write: every key as msgpack ``uint64`` (9 bytes
        each), the positions where the group changes, those of hashes below 2**32, and
        the group (one int, or one per key when it changes). None otherwise."""
        if self.hash_format != "int" or not items:
            return None
        stores_plain = len(self._described) == 0
        removals_plain = len(self._fanout) == 0
        total = 0
        for item in items:
            if isinstance(item, msgspec.Struct) or not item.keys or not (
                removals_plain if item.removed else stores_plain
            ):  # fmt: skip
                return None
            total += len(item.keys)
        if total < _ENCODE_MIN:
            return None
        width = len(items[0].keys[0])  # type: ignore[union-attr]
        every = itertools.chain.from_iterable(item.keys for item in items)  # type: ignore[union-attr]
        raw = b"".join(every)
        # No key shorter than the first, and none longer: every key has its length.
        if width < 12 or len(raw) != width * total or min(map(len, itertools.chain.from_iterable(
            item.keys for item in items  # type: ignore[union-attr]
        ))) != width:  # fmt: skip
            return None
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(total, width)
        wire = np.empty((total, 9), dtype=np.uint8)
        wire[:, 0] = 0xCF
        wire[:, 1:] = rows[:, width - 12 : width - GROUP_IDX_BYTES]
        records = np.frombuffer(raw, dtype=_record_dtype(width))
        small: list[int] = []
        if (records["hash"] < _SMALLEST_UINT64).any():
            small = np.flatnonzero(records["hash"] < _SMALLEST_UINT64).tolist()
        groups = records["group"]
        bounds = np.flatnonzero(groups[1:] != groups[:-1])
        if bounds.size:
            return wire.tobytes(), (bounds + 1).tolist(), small, groups.tolist()
        return wire.tobytes(), [], small, int(groups[0])

    def _template(self, removed: bool, medium: str, group: int) -> tuple[bytes, bytes]:
        """An event's encoding around its ``block_hashes`` array, made by msgspec once."""
        key = (removed, medium, group)
        found = self._templates.get(key)
        if found is not None:
            return found
        wire = self.wire_medium(medium)

        def event(hashes: list[Any]) -> Any:
            if removed:
                if self._removed_cls is BlockRemoved:
                    return BlockRemoved(hashes, wire.medium, group, wire.locality, wire.ownership)
                return ArrayBlockRemoved(hashes, wire.medium, group)
            return self._store_event(hashes, None, [], 0, None, None, None, group, None, None,
                                     wire)  # fmt: skip

        empty, one = self._encoder.encode(event([])), self._encoder.encode(event([1]))
        at = next(i for i, (a, b) in enumerate(zip(empty, one, strict=False)) if a != b)
        # [] is 0x90, [1] is 0x91 0x01; everything else is the same.
        assert empty[at] == 0x90 and one[at : at + 2] == b"\x91\x01", (empty, one)
        assert empty[at + 1 :] == one[at + 2 :]
        found = self._templates[key] = (empty[:at], empty[at + 1 :])
        return found


def array_header(n: int) -> bytes:
    """msgpack's array header for ``n`` elements (the smallest form, as msgspec writes)."""
    if n < 16:
        return _FIXARRAY[n]
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_FIXARRAY = tuple(bytes([0x90 | n]) for n in range(16))


def _crosses(positions: list[int], start: int, stop: int) -> bool:
    """Whether a sorted position lies in ``(start, stop)``: a group change inside an
    event's keys (``start`` its first key), or a small hash among them (``start - 1``)."""
    i = bisect.bisect_right(positions, start)
    return i < len(positions) and positions[i] < stop


_ENCODE_MIN = 300
"""Keys in a batch from which one numpy pass beats translating event by event (measured:
1.14x slower at ~200 keys, 0.85x at ~400, 0.65x at ~1,600; benchmarks/RESULTS.md)."""

_SMALLEST_UINT64 = 1 << 32
"""msgpack (and msgspec) write smaller unsigned ints in fewer bytes than ``0xcf``."""


_VECTOR_MIN = 8  # keys from which one numpy pass beats a Python loop


@functools.cache
def _record_dtype(key_length: int) -> np.dtype[Any] | None:
    """A key as a record: padding, the hash's last 8 bytes (big-endian), the group."""
    pad = key_length - 8 - GROUP_IDX_BYTES
    if pad < 0:
        return None  # hashes shorter than 8 bytes: the loop handles them
    fields: list[tuple[str, str]] = [("pad", f"V{pad}")] if pad else []
    return np.dtype([*fields, ("hash", ">u8"), ("group", ">u4")])
