"""The KV-event replay socket: a ROUTER anyone on the network may reach, with bounded work.

vLLM's replay protocol is a ROUTER that answers a start sequence number with
every buffered batch from there. Whoever can reach the port can send it
anything, as often as they like, and never read the answers; none of that
may make the publishing process allocate, queue or compute without bound, or
hold up the event loop it shares with the engine:

* **a frame** larger than :data:`MAX_REQUEST_BYTES` (``zmq.MAXMSGSIZE``) makes
  libzmq drop the peer before any of it is buffered or reaches Python;
* **a request** is answered with at most ``max_replay_bytes`` of payload,
  then the end marker (a client that wanted more asks again from the next
  sequence number, as it would after any gap);
* **a peer** has one replay at a time (a new request replaces the one in
  progress) and at most ``peer_hwm`` replies queued: replies go out with
  ``ROUTER_MANDATORY`` and ``DONTWAIT``, so a peer whose queue is full pauses
  its replay instead of growing the queue, and a replay that makes no
  progress for ``stall_timeout`` seconds is dropped (``replays_cut``);
* **at once**, ``max_replays`` replays are in progress and ``max_pending``
  requests wait; further requests are refused (``replays_refused``);
* **a tick** of the loop sends at most ``sends_per_tick`` replies (shared
  round-robin by the replays in progress) and reads at most
  ``requests_per_tick`` requests, then yields; when every replay is paused
  the task sleeps :data:`PAUSE` instead of spinning;
* **a malformed request** is counted and logged at most once per
  ``warn_interval`` seconds, with the number left unlogged since.

What each client socket receives (the ROUTER strips the routing identity;
DEALER keeps the empty delimiter, REQ removes it):

* DEALER (send ``[b"", start]``): ``[b"", topic, seq, payload]`` per batch,
  then ``[b"", b"", END_SEQ, b""]``;
* REQ (send ``start``): ``[topic, seq, payload]`` of the first batch only, or
  ``[b"", END_SEQ, b""]`` when there is none: REQ drops every later reply, so
  use a DEALER.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from aiokvo._settings import check_seconds
from aiokvo._util import check_int

__all__ = ["END_SEQ", "MAX_REQUEST_BYTES", "PAUSE", "ReplayLimits", "ReplayServer"]

logger = logging.getLogger("aiokvo.telemetry.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker's sequence frame (vLLM's ``END_SEQ``: ``ff`` x 8)."""

MAX_REQUEST_BYTES = 64
"""The largest frame a replay peer may send (a request is ``[b"", 8 bytes]``)."""

PAUSE = 0.002
"""Seconds the server sleeps when every replay in progress waits for its peer."""

_MORE = int(zmq.SNDMORE | zmq.DONTWAIT)
_LAST = int(zmq.DONTWAIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayLimits:
    """Bounds on what replay peers can make the publisher do (see the module docstring)."""

    max_replay_bytes: int = 8 << 20
    max_replays: int = 8
    max_pending: int = 64
    peer_hwm: int = 1024
    sends_per_tick: int = 64
    requests_per_tick: int = 64
    stall_timeout: float = 5.0
    warn_interval: float = 60.0

    def __post_init__(self) -> None:
        check_int("max_replay_bytes", self.max_replay_bytes, minimum=1)
        for name in ("max_replays", "peer_hwm", "sends_per_tick", "requests_per_tick"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("max_pending", self.max_pending, minimum=0)
        check_seconds("stall_timeout", self.stall_timeout)
        check_seconds("warn_interval", self.warn_interval, allow_zero=True)


@dataclass(slots=True)
class _Replay:
    identity: bytes
    next_seq: int
    stop_seq: int  # batches from next_seq up to (not including) this one
    budget: int  # payload bytes it may still send
    stalled_since: float | None = None


class _Limiter:
    """Allows one log line per ``interval`` seconds and counts the ones it held back."""

    __slots__ = ("_at", "_clock", "_interval", "held")

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self._interval = interval
        self._clock = clock
        self._at: float | None = None
        self.held = 0

    def allow(self) -> int | None:
        """None when this line is held back; else how many were held back since the last."""
        now = self._clock()
        if self._at is not None and now - self._at < self._interval:
            self.held += 1
            return None
        self._at = now
        held, self.held = self.held, 0
        return held


class ReplayServer:
    """Answers replay requests on ``router`` from ``buffer``, within :class:`ReplayLimits`.

    ``buffer`` is the publisher's ``deque`` of ``(seq, payload)`` in
    increasing ``seq`` (read, never changed here); ``next_seq()`` is the
    number the next live batch gets: a replay stops before it. The
    publisher's writer thread changes both while holding ``lock``, so they
    are read under it. ``clock`` is for tests.
    """

    def __init__(
        self,
        router: zmq.asyncio.Socket,
        buffer: deque[tuple[int, bytes]],
        topic: bytes,
        next_seq: Callable[[], int],
        limits: ReplayLimits,
        *,
        lock: AbstractContextManager[Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        # A synchronous view of the same socket: non-blocking sends and receives.
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(router.underlying)
        self._buffer = buffer
        self._lock = nullcontext() if lock is None else lock
        self._topic = topic
        self._next_live = next_seq
        self._limits = limits
        self._clock = clock
        self._active: dict[bytes, _Replay] = {}
        self._pending: dict[bytes, int] = {}  # identity -> start seq, in arrival order
        self._invalid_log = _Limiter(limits.warn_interval, clock)
        self._refused_log = _Limiter(limits.warn_interval, clock)
        self.requests = 0
        self.served = 0
        self.batches_sent = 0
        self.bytes_sent = 0
        self.invalid = 0
        self.refused = 0
        self.cut = 0
        self.truncated = 0
        self.max_sends_per_tick = 0

    @staticmethod
    def configure(router: zmq.asyncio.Socket, limits: ReplayLimits) -> None:
        """Socket options for a ROUTER that serves replays (before it binds)."""
        router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, limits.peer_hwm)
        router.setsockopt(zmq.RCVHWM, 16)

    @property
    def in_progress(self) -> int:
        return len(self._active)

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def run(self) -> None:
        """Serve until cancelled."""
        router = self._router
        while True:
            if not self._active and not self._pending:
                await router.poll()  # POLLIN
            self._read_requests()
            self._start_pending()
            if not self._active:
                continue
            if self._send_some():
                await asyncio.sleep(0)  # a tick's share is sent: the loop runs everything else
            else:
                await asyncio.sleep(PAUSE)  # every peer's queue is full: do not spin

    # -- requests ---------------------------------------------------------------------

    def _read_requests(self) -> None:
        sock = self._sock
        for _ in range(self._limits.requests_per_tick):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._request(frames)

    def _request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.invalid += 1
            held = self._invalid_log.allow()
            if held is not None:
                logger.warning(
                    "invalid KV event replay request (%d frames; a request is [b'', 8-byte "
                    "start]); %d more since the last warning. Ignored and counted "
                    "(statistics().invalid_replay_requests); at most one warning per %g s",
                    len(frames), held, self._limits.warn_interval,
                )
            return
        self.requests += 1
        identity, _, start = frames
        seq = int.from_bytes(start, "big")
        if identity in self._active:  # the peer asks again: it restarted its replay
            del self._active[identity]
        elif identity not in self._pending and len(self._pending) >= self._limits.max_pending:
            self.refused += 1
            held = self._refused_log.allow()
            if held is not None:
                logger.warning(
                    "KV event replay request refused: %d replays in progress and %d waiting "
                    "(max_replays, max_pending); %d more since the last warning "
                    "(statistics().replays_refused)",
                    len(self._active), len(self._pending), held,
                )
            return
        self._pending.pop(identity, None)
        self._pending[identity] = seq

    def _start_pending(self) -> None:
        pending, active = self._pending, self._active
        while pending and len(active) < self._limits.max_replays:
            identity = next(iter(pending))
            seq = pending.pop(identity)
            with self._lock:
                stop = self._next_live()
            active[identity] = _Replay(identity, seq, stop, self._limits.max_replay_bytes)

    # -- replies ----------------------------------------------------------------------

    def _send_some(self) -> bool:
        """Send this tick's share of replies; False when no replay could send anything."""
        budget = self._limits.sends_per_tick
        share = max(1, budget // len(self._active))
        sent = 0
        for replay in list(self._active.values()):
            n = self._advance(replay, min(share, budget - sent))
            sent += n
            if sent >= budget:
                break
        self.max_sends_per_tick = max(self.max_sends_per_tick, sent)
        return sent > 0

    def _advance(self, replay: _Replay, allowed: int) -> int:
        """Send up to ``allowed`` replies of ``replay``; how many went out."""
        sent = 0
        while sent < allowed:
            entry = self._next_entry(replay)
            if entry is None or len(entry[1]) > replay.budget:
                if entry is not None:
                    self.truncated += 1
                if self._send(replay, (b"", END_SEQ, b"")):
                    del self._active[replay.identity]
                    self.served += 1
                    sent += 1
                return sent
            seq, payload = entry
            if not self._send(replay, (self._topic, seq.to_bytes(8, "big"), payload)):
                return sent
            replay.next_seq = seq + 1
            replay.budget -= len(payload)
            self.batches_sent += 1
            self.bytes_sent += len(payload)
            sent += 1
        return sent

    def _next_entry(self, replay: _Replay) -> tuple[int, bytes] | None:
        with self._lock:
            return self._next_entry_locked(replay)

    def _next_entry_locked(self, replay: _Replay) -> tuple[int, bytes] | None:
        buffer = self._buffer
        if not buffer or replay.next_seq >= replay.stop_seq:
            return None
        first = buffer[0][0]
        i = replay.next_seq - first
        if i < 0:
            i = 0  # older than the buffer: from what is left
        elif i >= len(buffer) or buffer[i][0] != replay.next_seq:
            i = bisect_left(buffer, replay.next_seq, key=_seq)  # a gap from a failed send
        if i >= len(buffer) or buffer[i][0] >= replay.stop_seq:
            return None
        return buffer[i]

    def _send(self, replay: _Replay, frames: tuple[bytes, bytes, bytes]) -> bool:
        """One reply, never waiting: False (the replay paused or dropped) if it cannot go."""
        send = self._sock.send
        try:
            send(replay.identity, _MORE)  # ROUTER_MANDATORY: raises here, before any frame
        except zmq.Again:  # the peer's queue is full
            now = self._clock()
            if replay.stalled_since is None:
                replay.stalled_since = now
            elif now - replay.stalled_since >= self._limits.stall_timeout:
                self._drop(replay)
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._drop(replay)  # the peer went away
            return False
        replay.stalled_since = None
        topic, seq, payload = frames
        send(b"", _MORE)
        send(topic, _MORE)
        send(seq, _MORE)
        send(payload, _LAST)
        return True

    def _drop(self, replay: _Replay) -> None:
        self._active.pop(replay.identity, None)
        self.cut += 1


def _seq(entry: tuple[int, Any]) -> int:
    return int(entry[0])
