"""The replay ROUTER against peers on the network: real ZMQ sockets on loopback.

Whoever reaches the replay port may send any frames, as often as they like,
and never read: the publisher's memory, its per-request and per-tick work,
and its log stay bounded, and live publishing goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from aiokvo.errors import ConfigError
from aiokvo.keys import make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.specs import ReqContext
from aiokvo.telemetry.kv_events import END_SEQ, KVEventPublisher, ReplayLimits

pytestmark = pytest.mark.both_loops

LOOPBACK = "tcp://127.0.0.1:0"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``condition`` (a generous deadline, never a timing assumption)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


_made = itertools.count()


async def fill(publisher: KVEventPublisher, manager: CPUOffloadingManager, batches: int,
               keys_per_batch: int = 1) -> None:  # fmt: skip
    """Publish ``batches`` batches, each the stores of ``keys_per_batch`` new keys."""
    for _ in range(batches):
        b = next(_made)
        keys = [make_offload_key(f"{b}-{i}".encode().ljust(16, b"."), 0)
                for i in range(keys_per_batch)]
        out = manager.prepare_store(keys, ReqContext())
        assert out is not None
        manager.complete_store(out.keys_to_store)
        await publisher.flush()


def dealer(
    ctx: zmq.asyncio.Context, endpoint: str | None, **options: int
) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    if endpoint is not None:
        sock.connect(endpoint)
    return sock


async def replay(sock: zmq.asyncio.Socket, start: int) -> list[list[bytes]]:
    await sock.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        reply = await asyncio.wait_for(sock.recv_multipart(), 10)
        replies.append(reply)
        if reply[2] == END_SEQ:
            return replies


async def test_an_oversized_request_never_reaches_python_and_its_peer_is_dropped(
    zctx: zmq.asyncio.Context,
) -> None:
    """A 16 MiB frame used to be read whole (and copied) before it was found malformed;
    now libzmq refuses it (MAXMSGSIZE) and disconnects the peer."""
    manager = CPUOffloadingManager(64)
    async with KVEventPublisher(manager, LOOPBACK, replay_endpoint=LOOPBACK) as publisher:
        await fill(publisher, manager, 3)
        endpoint = publisher.replay_endpoint or ""
        big = dealer(zctx, None)
        monitor = big.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        big.connect(endpoint)  # after the monitor, so it sees the connection made
        events: list[int] = []

        async def next_event() -> int:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            events.append(event)
            return int(event)

        while await asyncio.wait_for(next_event(), 10) != zmq.EVENT_CONNECTED:
            pass
        await big.send_multipart([b"", bytes(16 << 20)])
        while await asyncio.wait_for(next_event(), 30) != zmq.EVENT_DISCONNECTED:
            pass  # the publisher's side closed the connection
        stats = publisher.statistics()
        assert stats.invalid_replay_requests == 0  # nothing of it reached Python
        assert stats.replays_served == 0
        good = dealer(zctx, endpoint)
        replies = await replay(good, 0)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 1, 2]
        big.disable_monitor()
        monitor.close(linger=0)


async def test_one_request_is_answered_with_at_most_max_replay_bytes(
    zctx: zmq.asyncio.Context,
) -> None:
    manager = CPUOffloadingManager(4096)
    limits = ReplayLimits(max_replay_bytes=1000)
    async with KVEventPublisher(manager, LOOPBACK, replay_endpoint=LOOPBACK,
                                replay_limits=limits) as publisher:
        await fill(publisher, manager, 12, keys_per_batch=20)
        sizes = [len(payload) for _, payload in publisher._writer.buffer]
        assert all(250 < size <= 500 for size in sizes), sizes
        sock = dealer(zctx, publisher.replay_endpoint or "")
        got: list[int] = []
        start = 0
        while start < 12:  # a client asks again from where a reply ended
            replies = await replay(sock, start)
            payload_bytes = sum(len(r[3]) for r in replies[:-1])
            assert 0 < payload_bytes <= 1000
            seqs = [int.from_bytes(r[2], "big") for r in replies[:-1]]
            got += seqs
            start = seqs[-1] + 1
        assert got == list(range(12))
        stats = publisher.statistics()
        assert stats.replays_truncated == 3 and stats.replay_bytes_sent == sum(sizes)


async def test_peers_that_never_read_neither_starve_the_loop_nor_queue_without_bound(
    zctx: zmq.asyncio.Context,
) -> None:
    """Eight peers ask again and again for an 8 MB buffer and never read. Between two
    wake-ups of any other task the replays send at most ``sends_per_tick`` replies;
    live publishing goes on; peers past ``max_replays + max_pending`` are refused; a
    peer that does not read is dropped once its queue (``peer_hwm``) stays full."""
    manager = CPUOffloadingManager(3000)  # each batch stores 3000 keys and evicts 3000
    limits = ReplayLimits(max_replay_bytes=64 << 20, max_replays=3, max_pending=2, peer_hwm=4,
                          sends_per_tick=16, stall_timeout=0.3)
    async with KVEventPublisher(manager, LOOPBACK, replay_endpoint=LOOPBACK,
                                replay_limits=limits, hwm=10) as publisher:
        await fill(publisher, manager, 150, keys_per_batch=3000)
        assert publisher.statistics().buffer_bytes > 6 << 20  # past any socket buffer
        endpoint = publisher.replay_endpoint or ""
        peers = [dealer(zctx, endpoint, RCVHWM=1, RCVBUF=4096) for _ in range(8)]
        for _ in range(5):
            for peer in peers:
                await peer.send_multipart([b"", bytes(8)])

        most = 0
        ticks = 0
        live_before = publisher.statistics().batches_sent
        last = publisher.statistics().replay_batches_sent
        while True:  # a task of the engine's: how much replay work ran between its wake-ups
            await asyncio.sleep(0)
            ticks += 1
            stats = publisher.statistics()
            most = max(most, stats.replay_batches_sent - last)
            last = stats.replay_batches_sent
            if ticks % 50 == 0:
                await fill(publisher, manager, 1)  # the engine goes on storing
                last = publisher.statistics().replay_batches_sent  # (fill awaited a while)
            if stats.replay_requests == 40 and not stats.replays_in_progress \
                    and not stats.replays_pending:
                break
            assert ticks < 2_000_000, "the replays never ended"
        stats = publisher.statistics()
        assert most <= limits.sends_per_tick
        assert stats.batches_sent > live_before  # published while replays were served
        assert stats.replays_refused >= 8 - limits.max_replays - limits.max_pending
        assert stats.replays_cut >= 1  # peers that do not read are dropped
        # Not 8 peers x 5 requests x 8 MB (what serving every request whole queued):
        # what the kernel's socket buffers took before each peer's queue stayed full.
        assert stats.replay_bytes_sent < 4 * stats.buffer_bytes


async def test_malformed_requests_are_counted_and_logged_once_per_interval(
    zctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiokvo.telemetry.kv_events")
    manager = CPUOffloadingManager(64)
    limits = ReplayLimits(warn_interval=0.2)
    async with KVEventPublisher(manager, LOOPBACK, replay_endpoint=LOOPBACK,
                                replay_limits=limits) as publisher:
        sock = dealer(zctx, publisher.replay_endpoint or "")
        for _ in range(50):
            await sock.send_multipart([b"", b"\x01", b"junk"])
        await until(lambda: publisher.statistics().invalid_replay_requests == 50, "50 counted")
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "0 more since the last warning" in warnings[0]
        await asyncio.sleep(0.25)  # past warn_interval (a clock fact, not a speed one)
        await sock.send_multipart([b"", b"\x01"])
        await until(lambda: publisher.statistics().invalid_replay_requests == 51, "51 counted")
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 2 and "49 more since the last warning" in warnings[1]
        # A good request after all that is still answered.
        assert await replay(sock, 0) == [[b"", b"", END_SEQ, b""]]


async def test_each_client_socket_type_gets_exactly_the_documented_frames(
    zctx: zmq.asyncio.Context,
) -> None:
    manager = CPUOffloadingManager(64)
    async with KVEventPublisher(manager, LOOPBACK, replay_endpoint=LOOPBACK,
                                topic="kv") as publisher:
        endpoint = publisher.replay_endpoint or ""
        req = zctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(endpoint)
        await req.send(bytes(8))  # nothing buffered yet: only the end marker
        assert await asyncio.wait_for(req.recv_multipart(), 10) == [b"", END_SEQ, b""]
        await fill(publisher, manager, 2)
        first, second = (payload for _, payload in publisher._writer.buffer)
        sock = dealer(zctx, endpoint)
        assert await replay(sock, 0) == [
            [b"", b"kv", (0).to_bytes(8, "big"), first],
            [b"", b"kv", (1).to_bytes(8, "big"), second],
            [b"", b"", END_SEQ, b""],
        ]
        await req.send(bytes(8))
        assert await asyncio.wait_for(req.recv_multipart(), 10) == [
            b"kv", (0).to_bytes(8, "big"), first,
        ]
        assert await req.poll(300) == 0  # REQ drops every later reply
    text = re.sub(r"\s+", " ", DOCS.read_text())
    for documented in (
        '`[b"", topic, seq, payload]` per batch, then `[b"", b"", END_SEQ, b""]`',
        '`[topic, seq, payload]` of the first batch only, or `[b"", END_SEQ, b""]`',
    ):
        assert documented in text


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_replay_bytes", 0), ("max_replays", 0), ("peer_hwm", -1), ("sends_per_tick", 1.5),
     ("max_pending", -1), ("stall_timeout", 0), ("warn_interval", -1)],
)
def test_bad_limits_are_refused_up_front(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        ReplayLimits(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="replay_limits"):
        KVEventPublisher(CPUOffloadingManager(4), LOOPBACK, replay_limits={})  # type: ignore[arg-type]


