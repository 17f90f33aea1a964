"""The publisher's wire bytes for recorded event streams, against the bytes it sent before.

Seeded streams (stores and removals in several groups, media and key lengths,
hashes small enough for msgpack's short ints, described requests, keys of
several router blocks whose removal fans out, a subscription that lags) go
through real publishers, as one batch per scheduler step, to a SUB on loopback
and to a replay client. Every batch (topic, seq counted from the stream's
first, payload with its wall-clock timestamp masked) must hash to what the
publisher sent when ``kv_golden.json`` was written, by the publisher as it
was before its work moved off the event loop:

    .venv/bin/python -m tests.telemetry.test_kv_golden --write

A change that alters one byte, the order of events or batches, or the
sequence numbers fails here, naming the first batch that differs.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import pytest
import zmq
import zmq.asyncio

from aiokvo.events import EventSubscription
from aiokvo.keys import OffloadKey
from aiokvo.manager.sink import EventSink, OverflowPolicy
from aiokvo.specs import BlockMetadata, OffloadingEvent
from aiokvo.telemetry.kv_events import END_SEQ, KVEventPublisher

pytestmark = pytest.mark.both_loops

GOLDEN = Path(__file__).with_name("kv_golden.json")
LOOPBACK = "tcp://127.0.0.1:0"
STEPS = 60
PROBE_GROUP = (9).to_bytes(4, "big")


@dataclass(frozen=True)
class Describe:
    keys: list[OffloadKey]
    metadata: BlockMetadata
    only: list[OffloadKey]


Action: TypeAlias = OffloadingEvent | Describe
Step: TypeAlias = list[Action]


@dataclass(frozen=True)
class Config:
    """One publisher and the stream it publishes."""

    name: str
    seed: int
    options: dict[str, Any]
    blocks_per_key: int = 1


CONFIGS = (
    Config("map-int", 1, {}),
    Config("array-int-lagging", 2, {"encoding": "array", "max_queue": 6, "on_lag": "clear",
                                    "batch_interval": 0}),
    Config("array-int", 5, {"encoding": "array"}),
    Config("map-bytes", 3, {"hash_format": "bytes", "data_parallel_rank": None,
                            "topic": "kv@pod@model"}),
    Config("map-int-fanout", 4, {"batch_interval": 0.001}, blocks_per_key=2),
)


def _hash(rng: random.Random, width: int) -> bytes:
    if rng.random() < 0.1:  # its last 8 bytes below 2**32: msgpack writes it shorter
        return bytes(width - 4) + rng.getrandbits(32).to_bytes(4, "big")
    return rng.getrandbits(8 * width).to_bytes(width, "big")


def make_stream(seed: int, blocks_per_key: int) -> list[Step]:
    """A seeded stream of scheduler steps: what a manager publishes, and describe calls."""
    rng = random.Random(seed)
    tokens = itertools.count()
    stored: list[tuple[OffloadKey, str]] = []
    steps: list[Step] = []
    for s in range(STEPS):
        big = s % 10 == 9  # ~400 keys, nothing described: the one-numpy-pass path
        step: Step = []
        for _ in range(12 if big else rng.randint(1, 6)):
            medium = rng.choice(["CPU"] * 6 + ["DISK", "MOONCAKE", "NVME"])
            # An eviction, maybe across groups (in a big step, of full-length keys).
            candidates = [i for i, (k, _) in enumerate(stored) if not big or len(k) == 36]
            if candidates and rng.random() < 0.5:
                count = min(len(candidates), rng.randint(1, 30))
                picked = sorted(rng.sample(candidates, count), reverse=True)
                gone = [stored.pop(i) for i in picked]
                step.append(OffloadingEvent([k for k, _ in gone], gone[0][1], True))
            width = 32 if big or rng.random() < 0.7 else rng.choice([16, 8, 4])
            group = 0 if rng.random() < 0.8 else rng.choice([1, 2, 70_000])
            n = rng.randint(30, 40) if big else rng.randint(1, 40)
            keys = [OffloadKey(_hash(rng, width) + group.to_bytes(4, "big")) for _ in range(n)]
            if not big and rng.random() < 0.4:
                first = rng.randint(0, n - 1)  # the request's hits are not stored again
                blocks = n * blocks_per_key
                hashes = None
                if blocks_per_key > 1 or rng.random() < 0.3:
                    hashes = [_hash(rng, 32) for _ in range(blocks)]
                metadata = BlockMetadata(
                    token_ids=[next(tokens) for _ in range(blocks * 16)],
                    block_size=16,
                    blocks_per_key=blocks_per_key,
                    block_hashes=hashes,
                    parent_block_hash=rng.choice([None, _hash(rng, 32)]),
                    lora_id=rng.choice([None, 7]),
                    lora_name=rng.choice([None, "sql-adapter"]),
                    extra_keys=rng.choice(
                        [None, [("img", i) if i % 3 else None for i in range(blocks)]]),
                    kv_cache_spec_kind=rng.choice([None, "full_attention", "sliding_window"]),
                    kv_cache_spec_sliding_window=rng.choice([None, 4096]),
                )
                step.append(Describe(keys, metadata, keys[first:]))
                keys = keys[first:]
            step.append(OffloadingEvent(keys, medium, False))
            stored.extend((k, medium) for k in keys)
        steps.append(step)
    return steps


class _Source:
    """A publisher source fed by hand: what a manager's subscribe() gives."""

    def __init__(self) -> None:
        self.sink = EventSink(record=False)

    def subscribe(self, *, maxsize: int = 1024,
                  overflow: OverflowPolicy = "drop_oldest") -> EventSubscription:
        return EventSubscription(self.sink, maxsize=maxsize, overflow=overflow)


def _frame_digest(topic: bytes, seq: int, payload: bytes) -> str:
    assert payload[1] == 0xCB, payload[:2]  # [ts (float64), events, rank]: mask ts
    masked = payload[:2] + bytes(8) + payload[10:]
    return hashlib.sha256(topic + b"\0" + seq.to_bytes(8, "big") + masked).hexdigest()[:24]


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def publish_stream(zctx: zmq.asyncio.Context, config: Config) -> list[str]:
    """Publish ``config``'s stream one batch per step; each batch's digest, checked to
    arrive live and from a replay with the same bytes and consecutive seqs."""
    steps = make_stream(config.seed, config.blocks_per_key)
    source = _Source()
    publish = source.sink.publish
    async with KVEventPublisher(source, LOOPBACK, replay_endpoint=LOOPBACK,
                                **config.options) as publisher:
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        for attempt in itertools.count():  # ZMQ's slow joiner: probe until one arrives
            assert attempt < 400, "the SUB socket never received a probe"
            probe = OffloadKey(b"probe" + attempt.to_bytes(4, "big") + PROBE_GROUP)
            publish(OffloadingEvent([probe], "CPU", False))
            await publisher.flush()
            if await sub.poll(25):
                break
        first = -1
        while await sub.poll(50):
            _, seq, _ = await sub.recv_multipart()
            first = int.from_bytes(seq, "big") + 1
        assert first == publisher.statistics().batches_sent
        for step in steps:
            for action in step:
                if isinstance(action, Describe):
                    publisher.describe(action.keys, action.metadata, only=action.only)
                else:
                    publish(action)
            await publisher.flush()
        live: list[list[bytes]] = []
        while len(live) < publisher.statistics().batches_sent - first:
            live.append(await asyncio.wait_for(sub.recv_multipart(), 10))
        assert not await sub.poll(50)
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint or "")
        await dealer.send_multipart([b"", first.to_bytes(8, "big")])
        replayed: list[list[bytes]] = []
        while True:
            reply = await asyncio.wait_for(dealer.recv_multipart(), 10)
            if reply[2] == END_SEQ:
                break
            replayed.append(reply[1:])
        stats = publisher.statistics()
    assert replayed == live  # the replay sends the very bytes sent live
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in live]
    assert seqs == list(range(first, first + len(live)))
    assert stats.send_errors == 0
    return [_frame_digest(topic, int.from_bytes(seq, "big") - first, payload)
            for topic, seq, payload in live]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
async def test_a_recorded_stream_goes_out_byte_for_byte_as_before(
    zctx: zmq.asyncio.Context, config: Config,
) -> None:
    expected = json.loads(GOLDEN.read_text())[config.name]
    got = await publish_stream(zctx, config)
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        assert a == b, f"{config.name}: batch {i} of the stream differs from the recorded bytes"
    assert len(got) == len(expected)


def test_the_streams_exercise_every_path() -> None:
    """The streams hold what the golden file is meant to pin down."""
    events = [a for c in CONFIGS for step in make_stream(c.seed, c.blocks_per_key)
              for a in step if isinstance(a, OffloadingEvent)]
    describes = [a for c in CONFIGS for step in make_stream(c.seed, c.blocks_per_key)
                 for a in step if isinstance(a, Describe)]
    keys = [k for e in events for k in e.keys]
    assert {len(k) for k in keys} == {8, 12, 20, 36}
    assert any(int.from_bytes(k[-12:-4], "big") < 1 << 32 for k in keys if len(k) == 36)
    assert {e.medium for e in events} == {"CPU", "DISK", "MOONCAKE", "NVME"}
    assert any(e.removed and len({k[-4:] for k in e.keys}) > 1 for e in events)
    assert any(d.metadata.block_hashes is not None and d.metadata.blocks_per_key == 2
               for d in describes)
    assert any(d.metadata.extra_keys is not None for d in describes)
    big = [sum(len(e.keys) for e in s if isinstance(e, OffloadingEvent))
           for s in make_stream(1, 1)]
    assert max(big) >= 300  # a batch large enough for the numpy path


async def _record() -> dict[str, list[str]]:
    ctx = zmq.asyncio.Context()
    try:
        return {c.name: await publish_stream(ctx, c) for c in CONFIGS}
    finally:
        ctx.destroy(linger=0)


def main(argv: Sequence[str]) -> int:
    if list(argv) != ["--write"]:
        print("usage: python -m tests.telemetry.test_kv_golden --write", file=sys.stderr)
        return 2
    GOLDEN.write_text(json.dumps(asyncio.run(_record()), indent=0) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
