"""Request traces in the Mooncake FAST'25 format (one JSON object a line).

Each line is a request: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, the prefix-block ids of its prompt in
order (an id names its whole prefix, so equal ids are reusable blocks).
:class:`~aiokvo.lab.record.TraceRecorder` writes the same format from a
running Offloader. Requests are replayed in timestamp order (ties keep
file order). Ids may be non-negative integers or strings; each becomes one
:data:`~aiokvo.keys.OffloadKey`, shared by every request that names it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike

from aiokvo.errors import TraceFormatError
from aiokvo.keys import OffloadKey, make_offload_key

__all__ = ["Trace", "parse_trace", "read_trace"]

HashId = int | str


@dataclass(frozen=True)
class Trace:
    """Requests as lists of block ids, and the keys the replay uses for them."""

    requests: tuple[tuple[HashId, ...], ...]
    keys: tuple[tuple[OffloadKey, ...], ...]
    timestamps: tuple[float, ...]

    @property
    def references(self) -> int:
        """Block references: the total length of every request."""
        return sum(map(len, self.requests))

    @property
    def distinct_blocks(self) -> int:
        """Distinct block ids; capacity fractions are of this."""
        return len({block for request in self.requests for block in request})

    def __len__(self) -> int:
        return len(self.requests)


def read_trace(path: str | PathLike[str]) -> Trace:
    """Read a JSONL trace file (see the module docstring)."""
    with open(path, encoding="utf-8") as lines:
        return parse_trace(lines, source=str(path))


def parse_trace(lines: Iterable[str], *, source: str = "<trace>") -> Trace:
    """Parse trace lines; a bad line raises :class:`TraceFormatError` naming it."""
    rows: list[tuple[float, int, tuple[HashId, ...]]] = []  # (timestamp, line, ids)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TraceFormatError(f"{source}:{number}: not JSON ({exc})") from None
        timestamp, ids = _request(record, source, number)
        rows.append((timestamp, number, ids))
    rows.sort(key=lambda row: (row[0], row[1]))
    keys: dict[HashId, OffloadKey] = {}
    requests = tuple(row[2] for row in rows)
    return Trace(
        requests=requests,
        keys=tuple(tuple(_key(block, keys) for block in request) for request in requests),
        timestamps=tuple(row[0] for row in rows),
    )


def _request(record: object, source: str, number: int) -> tuple[float, tuple[HashId, ...]]:
    where = f"{source}:{number}"
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {record!r:.80}")
    ids = record.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list, got {ids!r:.80}")
    for block in ids:
        if isinstance(block, bool) or not isinstance(block, (int, str)):
            raise TraceFormatError(f"{where}: hash id {block!r:.80} is not an int or a string")
        if isinstance(block, int) and not 0 <= block < 1 << 64:
            raise TraceFormatError(f"{where}: hash id {block} is not in [0, 2**64)")
    timestamp = record.get("timestamp", 0)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
        raise TraceFormatError(f"{where}: 'timestamp' must be a number, got {timestamp!r:.80}")
    return float(timestamp), tuple(ids)


def _key(block: HashId, keys: dict[HashId, OffloadKey]) -> OffloadKey:
    key = keys.get(block)
    if key is None:
        raw = block.to_bytes(8, "big") if isinstance(block, int) else b"s:" + block.encode()
        key = keys[block] = make_offload_key(raw, 0)
    return key

