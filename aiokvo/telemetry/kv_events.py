"""Publish aiokvo's cache events over ZMQ in vLLM's KV-event wire format.

KV-aware routers (llm-d's KV cache manager, NVIDIA Dynamo, Mooncake's
Conductor, ...) subscribe to vLLM's ``ZmqEventPublisher``. This publisher
speaks the same protocol, so they can index aiokvo's CPU tier (and later
tiers) exactly as they index vLLM's GPU blocks:

* a PUB socket sends ``[topic, seq (8 bytes, big-endian), payload]`` where
  ``payload`` is a msgpack ``[ts, events, data_parallel_rank]`` batch
  (:mod:`aiokvo.telemetry.kv_wire` has the event structs and the mapping);
* an optional ROUTER socket serves replays: a client sends a start sequence
  number (8 bytes, big-endian), gets the buffered batches from there, then
  the end marker (:mod:`aiokvo.telemetry.kv_replay` serves them within
  bounds any network peer can be allowed, and lists the exact frames each
  client socket type receives).

Nothing here runs on the manager's path. The manager pushes into a bounded
:class:`~aiokvo.events.EventSubscription` (it never waits); when events come,
a task on the loop waits ``batch_interval`` (2 ms) and hands what came, as
one batch, to the publisher's writer thread
(:mod:`aiokvo.telemetry.kv_writer`), which translates, encodes and sends it
there: the loop's share is two wake-ups and a queue put per batch, nothing
per key. An engine whose steps take longer gets one batch per step, as vLLM
publishes. Both sockets are ``zmq.asyncio`` sockets that never block: PUB
drops messages for a subscriber past its high-water mark (the subscriber sees
a gap in ``seq`` and can replay), and the replay ROUTER pauses, then drops,
a client that does not read. Memory is bounded by the subscription, the
replay buffer (batches and bytes) and the high-water marks. Events lost
before they got a sequence number (the subscription lagged) are counted in
:meth:`KVEventPublisher.statistics`; with ``on_lag="clear"`` an
``AllBlocksCleared`` marks the gap (see ``docs/telemetry.md`` for why that
is not the default).

Needs the ``kv-events`` extra (``pip install 'aiokvo[kv-events]'``: pyzmq
and msgspec).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

try:
    import msgspec  # noqa: F401  (needed by the modules below: named by this error)
    import zmq
    import zmq.asyncio
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "aiokvo.telemetry.kv_events needs pyzmq and msgspec: pip install 'aiokvo[kv-events]'"
    ) from exc

from aiokvo._util import AsyncResource, check_choice, check_int
from aiokvo.errors import ConfigError, SubscriptionClosed
from aiokvo.events import Lagged
from aiokvo.keys import OffloadKey
from aiokvo.manager.sink import OverflowPolicy
from aiokvo.specs import BlockMetadata, ReqContext
from aiokvo.telemetry.kv_replay import END_SEQ, ReplayLimits, ReplayServer
from aiokvo.telemetry.kv_wire import Encoding, EventTranslator, HashFormat, WireMedium
from aiokvo.telemetry.kv_writer import BatchWriter

__all__ = [
    "DEFAULT_BATCH_INTERVAL",
    "END_SEQ",
    "EventSource",
    "KVEventPublisher",
    "KVEventPublisherStatistics",
    "LagPolicy",
    "ReplayLimits",
]

logger = logging.getLogger(__name__)

LagPolicy = Literal["count", "clear"]
_LAG_POLICIES: tuple[LagPolicy, ...] = ("count", "clear")
DEFAULT_BATCH_INTERVAL = 0.002
"""Seconds of events one batch gathers by default (benchmarks/RESULTS.md, "KV events")."""


class _Subscription(Protocol):
    """What the publisher reads (``aiokvo.events.EventSubscription``)."""

    async def receive(self) -> Any: ...

    def drain_nowait(self) -> list[Any]: ...

    def qsize(self) -> int: ...

    @property
    def dropped(self) -> int: ...

    def close(self) -> None: ...


class EventSource(Protocol):
    """Anything that hands out event subscriptions: a manager, or an Offloader."""

    def subscribe(self, *, maxsize: int = ..., overflow: OverflowPolicy = ...) -> Any: ...


@dataclass(frozen=True, slots=True)
class KVEventPublisherStatistics:
    """A snapshot of a publisher's counters (see :meth:`KVEventPublisher.statistics`)."""

    batches_sent: int
    """Batches sent on the PUB socket (the next batch gets this sequence number)."""
    events_sent: int
    """KV events in those batches."""
    events_dropped: int
    """Source events lost because the subscription overflowed (never sent)."""
    lag_clears: int
    """``AllBlocksCleared`` events sent to mark such losses (``on_lag="clear"``)."""
    send_errors: int
    """Batches that failed to encode or send (logged; their sequence number is skipped)."""
    queued: int
    """Source events not yet published: in the subscription, or handed to the writer
    thread."""
    replay_requests: int
    """Well-formed replay requests received (a peer's new request replaces its old one)."""
    replays_served: int
    """Replay requests answered (each ends with the end marker)."""
    replay_batches_sent: int
    """Batches re-sent to replay clients."""
    replay_bytes_sent: int
    """Payload bytes of those batches."""
    invalid_replay_requests: int
    """Replay requests that were not ``[b"", start_seq]`` (ignored, as vLLM does)."""
    replays_refused: int
    """Replay requests not served: ``max_replays`` in progress and ``max_pending`` waiting."""
    replays_cut: int
    """Replays dropped because their peer stopped reading (``stall_timeout``) or went away."""
    replays_truncated: int
    """Replays that ended early at ``max_replay_bytes`` (the client asks again from there)."""
    replays_in_progress: int
    """Replays being sent now (``pending`` more waiting)."""
    replays_pending: int
    """Replay requests waiting for one in progress to end."""
    buffer_batches: int
    """Batches kept for replay now."""
    buffer_bytes: int
    """Payload bytes kept for replay now."""
    described_keys: int
    """Keys with caller metadata waiting for their store event."""
    described_dropped: int
    """Described keys forgotten unused (the metadata table is bounded)."""
    pub_mode: Literal["bind", "connect"]
    """How the PUB socket reached its endpoint: ``"bind"`` (subscribers connect to it)
    or ``"connect"`` (it connects to a bound subscriber or XSUB proxy)."""
    pub_endpoint: str
    """The PUB endpoint (after binding, the address actually bound)."""


class KVEventPublisher(AsyncResource):
    """Publishes KV events; BINDS ``tcp://*:PORT`` (or port 0, ipc, inproc), CONNECTS otherwise.

    ``async with KVEventPublisher(manager, "tcp://*:5557") as publisher:``
    binds (or connects), subscribes to ``source`` and publishes until the
    block ends; leaving it publishes what is still queued, then closes both
    sockets. ``source`` is anything with ``subscribe(maxsize=, overflow=)``
    returning an event subscription: a manager or an Offloader.

    Endpoints follow vLLM's ZmqEventPublisher rule: a wildcard host (``*``,
    ``::``), ``ipc://`` and ``inproc://`` bind, and so does TCP port 0 (an
    ephemeral port, read it back from :attr:`endpoint`); **any other address
    connects** (to an XSUB proxy, say), so ``"tcp://127.0.0.1:5557"``
    publishes to whoever *binds* there and to nobody if no one does. ``bind``
    overrides the rule. Which way it went is logged once at INFO when it
    starts and shown as ``statistics().pub_mode`` (``"bind"`` or
    ``"connect"``) and ``statistics().pub_endpoint``. The replay socket always
    binds.

    Options: ``encoding="array"`` for consumers pinned to vLLM <= 0.23;
    ``hash_format="bytes"`` for raw block hashes; ``media`` to rename media
    (:data:`~aiokvo.telemetry.kv_wire.DEFAULT_MEDIA`); ``buffer_steps`` and
    ``max_buffer_bytes`` bound the replay buffer; ``hwm`` is each socket's
    high-water mark; ``max_queue`` bounds the subscription; ``on_lag``
    decides what an overflow of it publishes; ``max_described`` bounds the
    metadata table (:meth:`describe`); ``batch_interval`` (seconds, default
    0.002) gathers the events of that long into one batch: an engine whose
    steps take longer (a real one: milliseconds) still gets one batch per step,
    as vLLM sends, at most 2 ms later; a scheduler that steps far more often
    pays the per-batch work once per interval. 0 sends one batch per loop
    wake-up. ``thread`` (default True) translates, encodes and sends each
    batch on a writer thread of the publisher's own, as vLLM's publisher does,
    so the loop's share is a hand-over per batch, not work per key; False
    does it all on the loop, in the pump task (no thread).
    ``replay_limits`` bounds what replay peers can make
    the publisher do (:class:`~aiokvo.telemetry.kv_replay.ReplayLimits`).
    ``context`` is a ``zmq.asyncio`` context to use (default: one of its
    own, terminated on close).
    """

    def __init__(
        self,
        source: EventSource,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: Encoding = "map",
        hash_format: HashFormat = "int",
        data_parallel_rank: int | None = 0,
        media: Mapping[str, WireMedium] | None = None,
        buffer_steps: int = 10_000,
        max_buffer_bytes: int = 64 << 20,
        hwm: int = 100_000,
        max_queue: int = 16_384,
        on_lag: LagPolicy = "count",
        max_described: int = 65_536,
        batch_interval: float = DEFAULT_BATCH_INTERVAL,
        thread: bool = True,
        bind: bool | None = None,
        replay_limits: ReplayLimits | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if not hasattr(source, "subscribe"):
            raise ConfigError(f"source must have a subscribe() method, got {source!r}")
        self._endpoint = _check_endpoint("endpoint", endpoint)
        self._replay_endpoint = (
            None if replay_endpoint is None else _check_endpoint("replay_endpoint", replay_endpoint)
        )
        if not isinstance(topic, str):
            raise ConfigError(f"topic must be a str, got {topic!r}")
        if data_parallel_rank is not None:
            check_int("data_parallel_rank", data_parallel_rank, minimum=0)
        self._translator = EventTranslator(
            encoding=encoding, hash_format=hash_format, media=media, max_described=max_described
        )
        self._buffer_steps = check_int("buffer_steps", buffer_steps, minimum=0)
        self._max_buffer_bytes = check_int("max_buffer_bytes", max_buffer_bytes, minimum=0)
        self._hwm = check_int("hwm", hwm, minimum=0)
        self._max_queue = check_int("max_queue", max_queue, minimum=1)
        self._on_lag: LagPolicy = check_choice("on_lag", on_lag, _LAG_POLICIES)
        if isinstance(batch_interval, bool) or not isinstance(batch_interval, int | float) \
                or not 0 <= batch_interval <= 60:
            raise ConfigError(f"batch_interval must be 0..60 seconds, got {batch_interval!r}")
        self._interval = float(batch_interval)
        if bind is not None and not isinstance(bind, bool):
            raise ConfigError(f"bind must be a bool or None, got {bind!r}")
        self._bind = _is_bind_endpoint(self._endpoint) if bind is None else bind
        if replay_limits is not None and not isinstance(replay_limits, ReplayLimits):
            raise ConfigError(f"replay_limits must be a ReplayLimits, got {replay_limits!r}")
        self._replay_limits = ReplayLimits() if replay_limits is None else replay_limits
        self._replayer: ReplayServer | None = None
        self._source = source
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._context = context
        self._own_context = context is None
        self._writer = BatchWriter(
            self._translator, topic=self._topic, rank=self._rank,
            buffer_steps=self._buffer_steps, max_buffer_bytes=self._max_buffer_bytes,
            on_lag=self._on_lag, max_queue=self._max_queue, thread=_check_bool("thread", thread),
        )

        self._sub: _Subscription | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._idle = asyncio.Event()
        self._held = 0  # the event the pump holds while it gathers a batch (0 or 1)
        self._state: Literal["new", "running", "closed"] = "new"

    # -- lifetime --------------------------------------------------------------------

    async def __aenter__(self) -> KVEventPublisher:
        await self.start()
        return self

    async def start(self) -> None:
        """Open the sockets, subscribe to the source and start publishing (idempotent)."""
        if self._state != "new":
            if self._state == "closed":
                raise ConfigError("this KVEventPublisher is closed; make a new one")
            return
        ctx = self._context
        if ctx is None:
            ctx = self._context = zmq.asyncio.Context()
        pub = router = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(self._hwm)
            if self._bind:
                self._endpoint = _bind(pub, self._endpoint)
            else:
                _ipv6(pub, self._endpoint)
                pub.connect(self._endpoint)
            if self._replay_endpoint is not None:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                ReplayServer.configure(router, self._replay_limits)
                self._replay_endpoint = _bind(router, self._replay_endpoint)
            self._sub = self._source.subscribe(maxsize=self._max_queue, overflow="drop_oldest")
        except BaseException:
            for sock in (pub, router):
                if sock is not None:
                    sock.close(linger=0)
            if self._own_context:
                ctx.term()
                self._context = None
            raise
        self._pub, self._router = pub, router
        # From here on only the writer thread uses the PUB socket (until it ends).
        self._writer.start(zmq.Socket.shadow(pub.underlying).send)
        self._state = "running"
        if self._bind:
            logger.info("KV events: PUB bound to %s; subscribers connect there%s",
                        self._endpoint, self._replay_note())
        else:
            logger.info(
                "KV events: PUB connecting to %s (a non-wildcard address connects, vLLM's "
                "rule): only a subscriber or XSUB proxy bound there receives events; give "
                "'tcp://*:PORT' or bind=True to bind instead%s",
                self._endpoint, self._replay_note(),
            )
        self._tasks.append(asyncio.create_task(self._pump(), name="aiokvo-kv-events-pub"))
        if router is not None:
            writer = self._writer
            self._replayer = ReplayServer(
                router, writer.buffer, self._topic, lambda: writer.seq, self._replay_limits,
                lock=writer.lock,
            )
            self._tasks.append(
                asyncio.create_task(self._replayer.run(), name="aiokvo-kv-events-replay")
            )

    async def aclose(self) -> None:
        """Publish what is queued, then close the sockets (idempotent)."""
        if self._state != "running":
            self._state = "closed"
            return
        self._state = "closed"
        assert self._sub is not None
        self._sub.close()  # the pump drains what is buffered, then ends
        pump, *others = self._tasks
        for task in others:
            task.cancel()
        try:
            await asyncio.gather(pump, *others, return_exceptions=True)
            await self._writer.stop()  # it sends what the pump handed over, then ends
        finally:
            self._writer.stop_nowait()  # a cancelled close: the socket must not outlive it
            for sock in (self._pub, self._router):
                if sock is not None:
                    sock.close(linger=0)
            if self._own_context and self._context is not None:
                self._context.term()
                self._context = None

    async def flush(self) -> None:
        """Wait until every event the source has made so far is sent."""
        while self._state == "running":
            await self._idle.wait()
            if not self._idle.is_set():
                continue  # woken, but the pump took events meanwhile and holds them
            assert self._sub is not None
            if not self._sub.qsize():
                await self._writer.wait()  # what the pump handed over is sent
                return
            await asyncio.sleep(0)

    # -- the caller's metadata -------------------------------------------------------

    def describe(
        self,
        keys: Sequence[OffloadKey],
        context: ReqContext | BlockMetadata,
        *,
        only: Collection[OffloadKey] | None = None,
    ) -> None:
        """Make the next store event of ``keys`` self-describing.

        Call it with the request's keys and a context carrying
        :class:`~aiokvo.specs.BlockMetadata` (token ids, block size, parent
        hash, LoRA, extra keys) around ``prepare_store``; pass
        ``only=out.keys_to_store`` to record just the blocks being stored.
        Synchronous and cheap: the checks run here (bad metadata raises
        :class:`~aiokvo.errors.ConfigError` at once); the writer thread
        records the entries just before the first event the source makes after
        this call, so a store event made before it never takes its metadata
        however late the batch is translated. See
        :meth:`EventTranslator.describe <aiokvo.telemetry.kv_wire.EventTranslator.describe>`.
        """
        description = self._translator.prepare_description(keys, context, only=only)
        if description is None:
            return
        sub = self._sub
        pushed = 0 if sub is None else (
            self._writer.events_handed + self._held + sub.qsize() + sub.dropped
        )
        self._writer.describe(pushed, description)

    # -- introspection ---------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The PUB endpoint; after binding, the address actually bound."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER endpoint (the address actually bound), or None without replay."""
        return self._replay_endpoint

    def statistics(self) -> KVEventPublisherStatistics:
        replayer = self._replayer
        writer = self._writer
        with writer.lock:
            seq, events_sent, send_errors = writer.seq, writer.events_sent, writer.send_errors
            buffer_batches, buffer_bytes = len(writer.buffer), writer.buffer_bytes
            in_flight = writer.in_flight
        return KVEventPublisherStatistics(
            batches_sent=seq - send_errors,
            events_sent=events_sent,
            events_dropped=writer.events_dropped,
            lag_clears=writer.lag_clears,
            send_errors=send_errors,
            queued=(self._sub.qsize() if self._sub is not None else 0) + self._held
            + in_flight,
            replay_requests=0 if replayer is None else replayer.requests,
            replays_served=0 if replayer is None else replayer.served,
            replay_batches_sent=0 if replayer is None else replayer.batches_sent,
            replay_bytes_sent=0 if replayer is None else replayer.bytes_sent,
            invalid_replay_requests=0 if replayer is None else replayer.invalid,
            replays_refused=0 if replayer is None else replayer.refused,
            replays_cut=0 if replayer is None else replayer.cut,
            replays_truncated=0 if replayer is None else replayer.truncated,
            replays_in_progress=0 if replayer is None else replayer.in_progress,
            replays_pending=0 if replayer is None else replayer.pending,
            buffer_batches=buffer_batches,
            buffer_bytes=buffer_bytes,
            described_keys=writer.described,
            described_dropped=self._translator.described_dropped,
            pub_mode="bind" if self._bind else "connect",
            pub_endpoint=self._endpoint,
        )

    def __repr__(self) -> str:
        mode = "bound to" if self._bind else "connecting to"
        return f"<KVEventPublisher {self._state} {mode} {self._endpoint!r} seq={self._writer.seq}>"

    def _replay_note(self) -> str:
        replay = self._replay_endpoint
        return "" if replay is None else f"; replay ROUTER bound to {replay}"

    # -- the tasks -------------------------------------------------------------------

    async def _pump(self) -> None:
        sub, writer = self._sub, self._writer
        assert sub is not None
        while True:
            self._idle.set()
            try:
                first = await sub.receive()
            except SubscriptionClosed:
                return
            self._idle.clear()
            # Taken from the subscription, not yet handed over: describe() and
            # statistics() count it.
            self._held = held = int(type(first) is not Lagged)
            if self._interval:  # gather more steps into this batch
                await asyncio.sleep(self._interval)
            if writer.in_flight >= self._max_queue:
                # The thread is behind: hand it nothing more until it has caught up, so
                # what waits stays bounded (the subscription drops and counts the rest).
                await writer.wait()
            events = sub.qsize() + held
            items = sub.drain_nowait()
            items.insert(0, first)
            writer.submit(items, events)
            self._held = 0


# -- endpoints ---------------------------------------------------------------------


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")
    return value


def _check_endpoint(name: str, endpoint: object) -> str:
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError(f"{name} must be a ZMQ endpoint like 'tcp://*:5557', got {endpoint!r}")
    return endpoint


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule (wildcards, ipc, inproc bind), plus TCP port 0."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    address = endpoint.split("://", 1)[1]
    return "*" in address or "::" in address or address.endswith(":0")


def _ipv6(sock: zmq.asyncio.Socket, endpoint: str) -> None:
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (the real port for port 0)."""
    _ipv6(sock, endpoint)
    sock.bind(endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) and bound else endpoint

