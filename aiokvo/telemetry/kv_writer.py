"""The KV-event publisher's writer thread: translation, encoding, sends, the replay buffer.

Everything the publisher does per key and per event runs here, off the
event loop that drives the scheduler: reading the keys of each event,
encoding the batch, the three sends and the replay buffer. The loop hands
over what it drained from the subscription, in one ``SimpleQueue.put`` per
batch, and is done. With the publisher's work on the loop, a scheduler
stepping every 100-300 µs paid +22 to +31% of its loop time; measured in
``benchmarks/RESULTS.md`` ("KV events"), with what the thread costs
instead. This is the design vLLM's own ``ZmqEventPublisher`` has for the
same reason (a thread behind a queue).

What crosses threads, and how:

* **work** goes one way through a ``queue.SimpleQueue`` (C, lock-free for
  the putter): batches of subscription items, each published as one batch,
  in order; barriers (``flush``); the stop marker;
* **descriptions** (``describe``) are checked on the loop and queued with
  the number of events the source had pushed at that moment; the thread
  records each just before the first event pushed after it, so a batch is
  translated exactly as it would have been at the moment its events were
  made, however far behind the thread runs;
* **the PUB socket** is used only by this thread between ``start`` and the
  thread's end (ZMQ sockets may move between threads, not be shared);
* **sequence numbers, the replay buffer and the counters** are written here
  under ``lock``; the replay server (on the loop) reads the buffer and the
  next sequence number under it, so a replay never sees a half-made entry.

The GIL still serialises Python: this thread's work (tens to hundreds of µs
a batch) runs when the loop waits (for the model runner, for I/O), or
between two of the loop's bytecodes. What it saves the loop is CPU time,
not the process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import zmq

from aiokvo.events import Lagged
from aiokvo.telemetry.kv_wire import Description, EventBatch, EventTranslator, array_header

__all__ = ["BatchWriter"]

logger = logging.getLogger("aiokvo.telemetry.kv_events")

_FLOAT64 = struct.Struct(">d")
_MORE = int(zmq.SNDMORE | zmq.DONTWAIT)  # plain ints: enum arithmetic per frame costs
_LAST = int(zmq.DONTWAIT)


class _Barrier:
    """Resolves ``future`` on its loop once everything queued before it is done."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
        self.loop = loop
        self.future = future

    def release(self) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self.loop.call_soon_threadsafe(_resolve, self.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_STOP = object()


class BatchWriter:
    """Publishes batches handed over by the loop, on a thread of its own.

    The loop calls :meth:`start`, :meth:`submit`, :meth:`describe`,
    :meth:`wait` and :meth:`stop`; the counters may be read from any thread.
    With ``thread=False`` the work is done inline, on the loop, as
    :meth:`submit` is called (no thread at all).
    """

    def __init__(
        self,
        translator: EventTranslator,
        *,
        topic: bytes,
        rank: int | None,
        buffer_steps: int,
        max_buffer_bytes: int,
        on_lag: Literal["count", "clear"],
        max_queue: int,
        thread: bool = True,
    ) -> None:
        self._translator = translator
        self._send: Callable[[bytes, int], object] | None = None
        self._topic = topic
        self._batch_frame = _batch_frame(rank)
        self._buffer_steps = buffer_steps
        self._max_buffer_bytes = max_buffer_bytes
        self._on_lag = on_lag
        self._max_queue = max_queue
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = (
            threading.Thread(target=self._run, name="aiokvo-kv-events", daemon=True)
            if thread else None
        )
        self.lock = threading.Lock()
        """Held while the buffer, ``seq`` and the counters change (the replay server reads
        the buffer under it)."""
        self.buffer: deque[tuple[int, bytes]] = deque()
        """``(seq, payload)`` of the batches kept for replay, in increasing ``seq``."""
        self.buffer_bytes = 0
        self.seq = 0
        """The sequence number the next batch gets."""
        self.events_sent = 0
        self.events_dropped = 0
        self.lag_clears = 0
        self.send_errors = 0
        # Single-writer counters: the loop writes the first of each pair, this thread
        # the second; their difference is what is still in flight.
        self.events_handed = 0
        """Events the loop handed over (the loop writes it)."""
        self._events_done = 0
        self._submitted = 0  # batches; the loop writes it
        self._processed = 0  # batches done; this thread writes it
        self._described_queued = 0
        self._described_recorded = 0
        # (events pushed before it, description), appended by the loop, taken here.
        self._descriptions: deque[tuple[int, Description]] = deque()
        self._position = 0  # events of the source seen here (drops included)

    # -- the loop's side ---------------------------------------------------------------

    def start(self, send: Callable[[bytes, int], object]) -> None:
        """Start the thread; ``send(frame, flags)`` is the PUB socket's synchronous send,
        which only the thread uses from now until it ends."""
        self._send = send
        if self._thread is not None:
            self._thread.start()

    def submit(self, items: list[Any], events: int) -> None:
        """Publish ``items`` (drained from the subscription: ``events`` events, and
        ``Lagged`` markers) as one batch."""
        self.events_handed += events
        self._submitted += 1
        if self._thread is None:
            self._process(items, events)
        else:
            self._inbox.put((items, events))

    def describe(self, pushed: int, description: Description) -> None:
        """Record ``description`` before the event the source pushes after ``pushed``.

        When the thread has seen every event pushed so far and is done with
        them, nothing can be translated before the next one: the entry is
        recorded at once, here (so descriptions never pile up while no events
        come).
        """
        if (
            not self._descriptions
            and pushed == self._position
            and self._submitted == self._processed
        ):
            self._translator.record_description(description)
            return
        self._described_queued += len(description.keys)
        self._descriptions.append((pushed, description))

    async def wait(self) -> None:
        """Until everything submitted so far is published."""
        if self._thread is None:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._inbox.put(_Barrier(loop, future))
        await future

    async def stop(self) -> None:
        """Publish what was submitted, then end the thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            return
        await self.wait()
        self.stop_nowait()

    def stop_nowait(self) -> None:
        """End the thread after what was submitted, and wait for it (blocks the caller:
        only for a close that was cancelled, when the socket must not outlive it)."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join()

    @property
    def in_flight(self) -> int:
        """Events handed over and not yet published (read it under ``lock`` for a value
        consistent with the counters)."""
        return self.events_handed - self._events_done

    @property
    def described(self) -> int:
        """Described keys waiting for their store event (recorded, or still queued)."""
        return self._translator.described + self._described_queued - self._described_recorded

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        get = self._inbox.get
        while True:
            work = get()
            if work is _STOP:
                return
            if isinstance(work, _Barrier):
                work.release()
                continue
            self._process(*work)

    def _process(self, items: list[Any], events: int) -> None:
        try:
            self._publish(items, events)
        except Exception:  # keep publishing; a router resyncs from the seq gap
            with self.lock:
                self.send_errors += 1
                self.seq += 1
                self._events_done += events
            logger.exception("KV event batch %d could not be published", self.seq - 1)
        finally:
            self._processed += 1

    def _publish(self, items: list[Any], events: int) -> None:
        batch = self._events(items)
        parts: list[bytes] = [b""]  # the batch's head goes first, once the count is known
        count = 0
        encode = self._translator.encode
        start = 0
        for i, item in enumerate(batch):
            if item is None:  # descriptions recorded here: encode what came before first
                count += encode(batch[start:i], parts) if i > start else 0
                start = i + 1
        count += encode(batch[start:] if start else batch, parts) if start < len(batch) else 0
        if not count:
            with self.lock:
                self._events_done += events
            return
        # EventBatch [ts, events, rank] around the encoded events: what msgspec writes.
        head, tail = self._batch_frame
        parts[0] = head + _FLOAT64.pack(time.time()) + array_header(count)
        parts.append(tail)
        payload = b"".join(parts)
        send = self._send
        assert send is not None
        # The sends and the counters under one hold of the lock (microseconds: the
        # sends never block), so that once a subscriber has the batch, statistics()
        # and a replay see it sent.
        with self.lock:
            seq = self.seq
            # A PUB send never blocks (past the HWM it drops): plain non-blocking sends.
            # Multipart is atomic: once the first frame is taken, the others are.
            try:
                send(self._topic, _MORE)
            except zmq.Again:  # pragma: no cover - PUB drops instead; kept for safety
                self.send_errors += 1
                self.seq = seq + 1
                self._events_done += events
                return
            send(seq.to_bytes(8, "big"), _MORE)
            send(payload, _LAST)
            self.seq = seq + 1
            self.events_sent += count
            self._events_done += events
            self._remember(seq, payload)

    def _events(self, items: list[Any]) -> list[Any]:
        """The batch's source events in order, ``AllBlocksCleared`` where events were lost,
        and None where descriptions were recorded (the encoder must not read ahead of it)."""
        descriptions = self._descriptions
        position = self._position
        if not descriptions and not any(type(item) is Lagged for item in items):
            self._position = position + len(items)
            return items
        batch: list[Any] = []
        record = self._translator.record_description
        for item in items:
            if isinstance(item, Lagged):
                position += item.missed
                self._lost(item.missed, batch)
                continue
            if descriptions and descriptions[0][0] <= position:
                while descriptions and descriptions[0][0] <= position:
                    _, description = descriptions.popleft()
                    record(description)
                    self._described_recorded += len(description.keys)
                batch.append(None)
            batch.append(item)
            position += 1
        self._position = position
        return batch

    def _lost(self, missed: int, batch: list[Any]) -> None:
        if not self.events_dropped:
            logger.warning(
                "KV event subscription overflowed: %d events lost (max_queue=%d); "
                "routers miss them (see statistics().events_dropped)",
                missed, self._max_queue,
            )
        self.events_dropped += missed
        if self._on_lag == "clear":
            self.lag_clears += 1
            batch.append(self._translator.all_cleared())

    def _remember(self, seq: int, payload: bytes) -> None:
        if not self._buffer_steps:
            return
        buffer = self.buffer
        buffer.append((seq, payload))
        self.buffer_bytes += len(payload)
        while len(buffer) > self._buffer_steps or (
            self.buffer_bytes > self._max_buffer_bytes and buffer
        ):
            self.buffer_bytes -= len(buffer.popleft()[1])


def _batch_frame(rank: int | None) -> tuple[bytes, bytes]:
    """msgspec's encoding of ``EventBatch(ts, events, rank)`` around ``ts`` and ``events``:
    the array header and the float marker before ``ts``, and what follows the events."""
    empty = msgspec.msgpack.encode(EventBatch(0.0, [], rank))
    # [0x93|0x92] [0xcb + 8 bytes of ts] [0x90: no events] [rank]
    assert empty[1] == 0xCB and empty[10] == 0x90, empty
    return empty[:2], empty[11:]
