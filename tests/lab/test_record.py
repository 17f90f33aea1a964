"""Recording a running Offloader's requests, then replaying them."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from aiokvo import Offloader
from aiokvo.errors import ConfigError, UnsafeFileError
from aiokvo.lab.record import TraceRecorder, hash_id
from aiokvo.lab.replay import replay
from aiokvo.lab.trace import read_trace
from tests.offloader._harness import KV, keys


async def test_an_offloader_records_each_request_and_the_trace_replays(tmp_path: Path) -> None:
    kv = KV(32)
    path = tmp_path / "traffic.jsonl"
    a, b, c, d = keys("a", "b", "c", "d")
    async with Offloader(kv.config(8), kv.caches) as off:
        async with TraceRecorder(path, block_tokens=16) as recorder:
            off.recorder = recorder
            assert await off.load_prefix([a, b], [0, 1]) == 0  # a first turn: a miss
            kv.write([0, 1], [a, b])
            await off.store([a, b], [0, 1])
            assert await off.load_prefix([a, b, c], [2, 3, 4]) == 2  # its next turn
            lease = off.pin_prefix([a, b, d])
            assert lease is not None and lease.count == 2
            lease.release()
            off.recorder = None
            await off.load_prefix([d], [5])  # not recorded
        stats = recorder.statistics()
    assert (stats.recorded, stats.written, stats.dropped, stats.buffered) == (3, 3, 0, 0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["hash_ids"] for row in rows] == [
        [hash_id(a), hash_id(b)], [hash_id(a), hash_id(b), hash_id(c)],
        [hash_id(a), hash_id(b), hash_id(d)],
    ]  # fmt: skip
    assert [row["input_length"] for row in rows] == [32, 48, 48]
    assert rows[0]["timestamp"] == 0
    assert rows[0]["timestamp"] <= rows[1]["timestamp"] <= rows[2]["timestamp"]
    trace = read_trace(path)
    assert replay(trace.keys, "lru", 8).hits == 4  # a,b hit by the second and third


def test_the_buffer_and_the_limit_are_bounds(tmp_path: Path) -> None:
    ticks = iter(range(100))
    recorder = TraceRecorder(tmp_path / "t.jsonl", buffer=2, max_requests=3,
                             interval=60, clock=lambda: float(next(ticks)))  # fmt: skip
    recorder([b"x" * 8])  # not open yet: dropped
    with recorder:
        for n in range(6):  # the writer sleeps (interval 60 s) unless woken by a half-full buffer
            recorder([bytes([n]) * 8])
    stats = recorder.statistics()
    assert stats.recorded <= 3 and stats.written == stats.recorded
    assert stats.recorded + stats.dropped == 7
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == stats.written


def test_an_existing_file_or_a_symlink_is_refused(tmp_path: Path) -> None:
    existing = tmp_path / "old.jsonl"
    existing.write_text("keep me\n")
    with pytest.raises(ConfigError, match="exists"), TraceRecorder(existing):
        pass
    assert existing.read_text() == "keep me\n"
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(UnsafeFileError, match="symbolic link"), TraceRecorder(link):
        pass
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_hash_ids_are_stable_53_bit_integers() -> None:
    ids = {hash_id(bytes([n]) * 20) for n in range(256)}
    assert len(ids) == 256
    assert all(0 <= i < 1 << 53 for i in ids)
    assert hash_id(b"same key") == hash_id(b"same key")
