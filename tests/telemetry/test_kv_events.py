"""The ZMQ publisher, end to end: a real SUB socket and a real replay client on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from aiokvo.errors import ConfigError
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.specs import BlockMetadata, ReqContext
from aiokvo.telemetry.kv_events import END_SEQ, KVEventPublisher
from aiokvo.telemetry.kv_wire import EventTranslator
from tests.telemetry import vllm_spec as spec

pytestmark = pytest.mark.both_loops

LOOPBACK = "tcp://127.0.0.1:0"
CTX = ReqContext()


def key(i: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(f"block{i}".encode()).digest(), 0)


def ext(k: OffloadKey) -> int:
    return spec.external_hash(k[:-4])


def store(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> list[OffloadKey]:
    out = manager.prepare_store(keys, CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    return out.evicted_keys


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


class Sub:
    """A SUB socket that is known to be subscribed: it has seen a probe batch."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock

    async def recv(self, timeout: float = 5.0) -> tuple[bytes, int, bytes]:
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    async def recv_batch(self) -> tuple[int, spec.KVEventBatch]:
        _, seq, payload = await self.recv()
        return seq, spec.MAP_DECODER.decode(payload)


async def subscribe(
    zctx: zmq.asyncio.Context, publisher: KVEventPublisher, manager: CPUOffloadingManager,
    prefix: bytes = b"",
) -> tuple[Sub, int]:
    """Connect a SUB and probe until it receives; returns it and the next seq to expect.

    PUB drops everything until the subscription has reached it (ZMQ's slow
    joiner), so this stores probe keys until one arrives instead of sleeping.
    """
    sock = zctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, prefix)
    sock.connect(publisher.endpoint)
    for attempt in range(200):
        store(manager, [make_offload_key(b"probe" + attempt.to_bytes(4, "big"), 9)])
        await publisher.flush()
        if await sock.poll(25):
            break
    else:
        raise AssertionError("the SUB socket never received a probe")
    last = -1
    while await sock.poll(25):
        _, seq, _ = await sock.recv_multipart()
        last = int.from_bytes(seq, "big")
    return Sub(sock), last + 1


async def test_sub_receives_stores_and_evictions_in_vllm_frames(
    zctx: zmq.asyncio.Context,
) -> None:
    manager = CPUOffloadingManager(256)
    async with KVEventPublisher(manager, LOOPBACK, topic="kv@pod-a@model",
                                data_parallel_rank=3) as publisher:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        assert not publisher.endpoint.endswith(":0")
        sub, seq0 = await subscribe(zctx, publisher, manager, prefix=b"kv@pod-a")
        manager.complete_store([])  # nothing happens: no batch
        k0, k1, k2 = key(0), key(1), key(2)
        store(manager, [k0, k1])
        await publisher.flush()
        store(manager, [key(1000 + i) for i in range(manager.num_free_blocks)])  # full
        await publisher.flush()
        evicted = store(manager, [k2])
        topic, seq, payload = await sub.recv()
        assert (topic, seq) == (b"kv@pod-a@model", seq0)
        batch = spec.MAP_DECODER.decode(payload)
        assert batch.data_parallel_rank == 3
        assert batch.events == [spec.BlockStored([ext(k0), ext(k1)], None, [], 0, None, "CPU",
                                                 None, group_idx=0, locality="LOCAL")]
        await sub.recv()  # the filler
        seq, batch = await sub.recv_batch()
        assert seq == seq0 + 2
        # One tick, two manager events (an eviction, then a store): one batch.
        assert len(evicted) == 1
        assert batch.events == [
            spec.BlockRemoved([ext(k) for k in evicted], "CPU", evicted[0][-1], "LOCAL"),
            spec.BlockStored([ext(k2)], None, [], 0, None, "CPU", None, group_idx=0,
                             locality="LOCAL"),
        ]
        stats = publisher.statistics()
        assert stats.batches_sent == seq0 + 3
        assert stats.events_dropped == 0 and stats.queued == 0


async def test_self_describing_stores_carry_the_callers_metadata(
    zctx: zmq.asyncio.Context,
) -> None:
    manager = CPUOffloadingManager(16)
    async with KVEventPublisher(manager, LOOPBACK) as publisher:
        sub, _ = await subscribe(zctx, publisher, manager)
        keys = [key(i) for i in range(3)]
        ctx = ReqContext(block_metadata=BlockMetadata(
            token_ids=list(range(48)), block_size=16, lora_name="sql", lora_id=1))
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        publisher.describe(keys, ctx, only=out.keys_to_store)
        manager.complete_store(out.keys_to_store)
        _, batch = await sub.recv_batch()
        (event,) = batch.events
        assert isinstance(event, spec.BlockStored)
        assert event.block_hashes == [ext(k) for k in keys]
        assert event.token_ids == list(range(48)) and event.block_size == 16
        assert (event.lora_name, event.lora_id, event.parent_block_hash) == ("sql", 1, None)
        assert publisher.statistics().described_keys == 0


async def test_a_replay_client_gets_buffered_batches_then_the_end_marker(
    zctx: zmq.asyncio.Context,
) -> None:
    manager = CPUOffloadingManager(64)
    async with KVEventPublisher(manager, LOOPBACK, replay_endpoint=LOOPBACK, topic="t",
                                buffer_steps=4) as publisher:
        assert publisher.replay_endpoint is not None
        for i in range(6):
            store(manager, [key(i)])
            await publisher.flush()
        assert publisher.statistics().buffer_batches == 4  # seqs 2..5

        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)

        async def replay(start: int) -> list[list[bytes]]:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            frames = []
            while True:
                reply = await asyncio.wait_for(dealer.recv_multipart(), 5)
                frames.append(reply)
                if reply[2] == END_SEQ:
                    return frames

        replies = await replay(3)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [3, 4, 5]
        for (empty, topic, _, payload), i in zip(replies[:-1], (3, 4, 5), strict=True):
            assert (empty, topic) == (b"", b"t")
            (event,) = spec.MAP_DECODER.decode(payload).events
            assert event.block_hashes == [ext(key(i))]
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        assert int.from_bytes(END_SEQ, "big", signed=True) == -1
        # Older than the buffer: what is left; newer than the last: only the marker.
        assert [int.from_bytes(r[2], "big") for r in (await replay(0))[:-1]] == [2, 3, 4, 5]
        assert await replay(99) == [[b"", b"", END_SEQ, b""]]
        # A malformed request gets no reply, and the next good one still works.
        await dealer.send_multipart([b"", b"\x01", b"extra"])
        assert len(await replay(5)) == 2
        stats = publisher.statistics()
        assert (stats.replays_served, stats.invalid_replay_requests) == (4, 1)
        assert stats.replay_batches_sent == 3 + 4 + 0 + 1


async def test_a_lagging_subscription_is_counted_and_can_clear_the_router(
    zctx: zmq.asyncio.Context,
) -> None:
    manager = CPUOffloadingManager(64)
    async with KVEventPublisher(manager, LOOPBACK, max_queue=2, on_lag="clear",
                                replay_endpoint=LOOPBACK) as publisher:
        for i in range(5):  # one tick, five events, room for two
            store(manager, [key(i)])
        await publisher.flush()
        stats = publisher.statistics()
        assert (stats.events_dropped, stats.lag_clears, stats.batches_sent) == (3, 1, 1)
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint or "")
        await dealer.send_multipart([b"", bytes(8)])
        _, _, _, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
        events = spec.MAP_DECODER.decode(payload).events
        assert isinstance(events[0], spec.AllBlocksCleared)
        assert [e.block_hashes for e in events[1:]] == [[ext(key(3))], [ext(key(4))]]


@pytest.mark.parametrize("thread", [True, False])
async def test_translation_and_sends_run_on_the_writer_thread_not_the_loop(
    monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    """The publisher's per-key work is off the loop's thread (issue 22); thread=False
    keeps it on the loop."""
    seen: list[int] = []
    encode = EventTranslator.encode

    def spy(self: EventTranslator, items: object, out: list[bytes]) -> int:
        seen.append(threading.get_ident())
        return encode(self, items, out)  # type: ignore[arg-type]

    monkeypatch.setattr(EventTranslator, "encode", spy)
    manager = CPUOffloadingManager(64)
    async with KVEventPublisher(manager, LOOPBACK, thread=thread) as publisher:
        for i in range(3):
            store(manager, [key(i)])
            await publisher.flush()
        assert publisher.statistics().events_sent == 3
    loop_thread = threading.get_ident()
    assert len(seen) == 3
    assert all((ident != loop_thread) is thread for ident in seen), (seen, loop_thread)


async def test_a_writer_thread_that_falls_behind_is_handed_a_bounded_backlog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Events wait in the subscription (bounded, overflow counted), not in an unbounded
    hand-over queue, while the writer thread is stuck."""
    from aiokvo.telemetry.kv_writer import BatchWriter

    gate = threading.Event()
    publish = BatchWriter._publish

    def stuck(self: BatchWriter, items: list[object], events: int) -> None:
        gate.wait(30)
        publish(self, items, events)

    monkeypatch.setattr(BatchWriter, "_publish", stuck)
    manager = CPUOffloadingManager(64)
    async with KVEventPublisher(manager, LOOPBACK, max_queue=4, batch_interval=0) as publisher:
        try:
            in_flight = []
            for i in range(40):  # forty ticks of one event while the thread is stuck
                store(manager, [key(i)])
                for _ in range(3):
                    await asyncio.sleep(0)
                in_flight.append(publisher._writer.in_flight)
            stats = publisher.statistics()
        finally:
            gate.set()  # whatever failed, let the thread go
        assert max(in_flight) <= 2 * 4, in_flight
        assert stats.queued <= 3 * 4, stats  # in the subscription, held, handed over
        await publisher.flush()
        stats = publisher.statistics()
        assert stats.events_dropped > 0, stats  # counted as the thread reaches the gap
        assert stats.events_sent + stats.events_dropped == 40 and stats.queued == 0


async def test_describe_while_the_pump_holds_an_older_store_of_the_key(
    zctx: zmq.asyncio.Context,
) -> None:
    """A store event made before describe() never takes its metadata, even when the
    pump has already taken it from the subscription and is gathering its batch."""
    manager = CPUOffloadingManager(1)
    ctx = ReqContext(block_metadata=BlockMetadata(token_ids=list(range(16)), block_size=16))
    async with KVEventPublisher(manager, LOOPBACK, batch_interval=0.2) as publisher:
        sub, _ = await subscribe(zctx, publisher, manager)
        k, other = key(0), key(1)
        assert store(manager, [k])  # two events: a probe evicted, a placeholder store of k
        sub_queue = publisher._sub
        assert sub_queue is not None
        for _ in range(1000):  # until the pump has taken the first (and waits out the interval)
            await asyncio.sleep(0)
            if sub_queue.qsize() < 2:
                break
        assert sub_queue.qsize() == 1
        assert publisher.statistics().queued == 2  # the one the pump holds is counted
        publisher.describe([k], ctx)  # for k's *next* store
        await publisher.flush()
        _, batch = await sub.recv_batch()
        stored = [e for e in batch.events if isinstance(e, spec.BlockStored)]
        assert [(e.block_hashes, e.token_ids) for e in stored] == [([ext(k)], [])]
        assert publisher.statistics().described_keys == 1
        store(manager, [other])  # evicts k
        store(manager, [k])  # evicts other; k's next store: described
        await publisher.flush()
        _, batch = await sub.recv_batch()
        stored = [e for e in batch.events if isinstance(e, spec.BlockStored)]
        assert [(e.block_hashes, e.token_ids) for e in stored] == [
            ([ext(other)], []), ([ext(k)], list(range(16)))]
        assert publisher.statistics().described_keys == 0


async def test_a_batch_interval_gathers_several_ticks_into_one_batch() -> None:
    manager = CPUOffloadingManager(64)
    async with KVEventPublisher(manager, LOOPBACK, batch_interval=0.05) as publisher:
        for i in range(3):  # three scheduler steps, each ending in an await
            store(manager, [key(i)])
            await asyncio.sleep(0)
        await publisher.flush()
        stats = publisher.statistics()
        assert (stats.batches_sent, stats.events_sent) == (1, 3)


async def test_no_subscriber_never_blocks_and_the_buffer_stays_bounded() -> None:
    manager = CPUOffloadingManager(1)
    async with KVEventPublisher(manager, LOOPBACK, hwm=1, buffer_steps=1000,
                                max_buffer_bytes=500) as publisher:
        for i in range(300):
            store(manager, [key(i)])
            await publisher.flush()
        stats = publisher.statistics()
        assert stats.batches_sent == 300 and stats.send_errors == 0
        assert stats.buffer_bytes <= 500 and 0 < stats.buffer_batches < 300


async def test_array_encoding_over_the_wire(zctx: zmq.asyncio.Context) -> None:
    manager = CPUOffloadingManager(4)
    async with KVEventPublisher(manager, LOOPBACK, encoding="array") as publisher:
        sub, _ = await subscribe(zctx, publisher, manager)
        store(manager, [key(0)])
        _, _, payload = await sub.recv()
        batch = spec.ARRAY_DECODER.decode(payload)
        assert batch.events == [spec.OldBlockStored([ext(key(0))], None, [], 0, None, "CPU",
                                                    None, None, 0)]


async def test_connect_mode_reaches_a_bound_subscriber(zctx: zmq.asyncio.Context) -> None:
    sock = zctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.bind(LOOPBACK)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    manager = CPUOffloadingManager(300)
    async with KVEventPublisher(manager, endpoint) as publisher:  # a host address: connects
        assert publisher.endpoint == endpoint
        for i in range(200):
            store(manager, [key(i)])
            await publisher.flush()
            if await sock.poll(25):
                break
        _, _, payload = await sock.recv_multipart()
        assert spec.MAP_DECODER.decode(payload).events[0].medium == "CPU"


async def test_close_publishes_what_is_queued_and_is_final() -> None:
    manager = CPUOffloadingManager(8)
    publisher = KVEventPublisher(manager, LOOPBACK)
    await publisher.aclose()  # never started: nothing to do
    with pytest.raises(ConfigError, match="closed"):
        await publisher.start()

    publisher = KVEventPublisher(manager, LOOPBACK)
    async with publisher:
        store(manager, [key(0)])
        store(manager, [key(1)])  # still queued when the block ends
    stats = publisher.statistics()
    assert (stats.batches_sent, stats.events_sent) == (1, 2)
    await publisher.aclose()  # idempotent
    store(manager, [key(2)])  # the subscription is gone: the manager does not care
    assert publisher.statistics().events_sent == 2
    # The port is free again.
    async with KVEventPublisher(manager, publisher.endpoint) as again:
        assert again.endpoint == publisher.endpoint


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((CPUOffloadingManager(1), "127.0.0.1:5557"), {}, "endpoint must be a ZMQ endpoint"),
        ((object(), LOOPBACK), {}, "source must have a subscribe"),
        ((CPUOffloadingManager(1), LOOPBACK), {"encoding": "xml"}, "encoding must be one of"),
        ((CPUOffloadingManager(1), LOOPBACK), {"on_lag": "panic"}, "on_lag must be one of"),
        ((CPUOffloadingManager(1), LOOPBACK), {"max_queue": 0}, "max_queue must be an int >= 1"),
        ((CPUOffloadingManager(1), LOOPBACK), {"topic": b"x"}, "topic must be a str"),
        ((CPUOffloadingManager(1), LOOPBACK), {"bind": "yes"}, "bind must be a bool"),
        ((CPUOffloadingManager(1), LOOPBACK), {"thread": 1}, "thread must be a bool, got 1"),
        ((CPUOffloadingManager(1), LOOPBACK), {"batch_interval": -1},
         "batch_interval must be 0..60 seconds, got -1"),
        ((CPUOffloadingManager(1), LOOPBACK), {"data_parallel_rank": -1},
         "data_parallel_rank must be an int >= 0, got -1"),
    ],
)
def test_bad_options_are_refused_up_front(
    args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        KVEventPublisher(*args, **kwargs)  # type: ignore[arg-type]


async def test_a_port_in_use_fails_start_and_leaks_no_socket() -> None:
    manager = CPUOffloadingManager(1)
    async with KVEventPublisher(manager, LOOPBACK) as first:
        second = KVEventPublisher(manager, first.endpoint, bind=True)
        with pytest.raises(zmq.ZMQError):
            await second.start()
        store(manager, [key(0)])  # the failed publisher did not subscribe
        await first.flush()
        assert first.statistics().events_sent == 1


async def test_start_says_once_at_info_whether_it_bound_or_connects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host address connects (vLLM's rule) and publishes to nobody unless someone binds
    there: the first docstring line, one INFO line and the statistics all say which."""
    first_line = (KVEventPublisher.__doc__ or "").splitlines()[0]
    assert "BINDS" in first_line and "CONNECTS" in first_line
    caplog.set_level(logging.INFO, logger="aiokvo.telemetry.kv_events")
    manager = CPUOffloadingManager(4)
    async with KVEventPublisher(manager, LOOPBACK, replay_endpoint=LOOPBACK) as bound:
        stats = bound.statistics()
        assert stats.pub_mode == "bind" and stats.pub_endpoint == bound.endpoint
        assert not stats.pub_endpoint.endswith(":0")  # the port actually bound
        connect_to = "tcp://127.0.0.1:" + bound.endpoint.rsplit(":", 1)[1]
    async with KVEventPublisher(manager, connect_to) as connecting:
        stats = connecting.statistics()
        assert (stats.pub_mode, stats.pub_endpoint) == ("connect", connect_to)
        store(manager, [key(0)])
        await connecting.flush()
    messages = [r.getMessage() for r in caplog.records if r.name == "aiokvo.telemetry.kv_events"]
    assert len(messages) == 2 and all(
        r.levelno == logging.INFO for r in caplog.records if r.name == "aiokvo.telemetry.kv_events"
    )
    assert messages[0].startswith(f"KV events: PUB bound to {bound.endpoint}")
    assert f"replay ROUTER bound to {bound.replay_endpoint}" in messages[0]
    assert messages[1].startswith(f"KV events: PUB connecting to {connect_to}")
    assert "bind=True" in messages[1]
