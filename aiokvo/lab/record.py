"""Record a running Offloader's requests as a trace that ``aiokvo replay`` reads.

Opt-in and off the hot path: the Offloader calls the recorder once per
``load_prefix`` / ``pin_prefix`` with that request's keys, and the call
only appends ``(time, keys)`` to a bounded buffer (a full buffer drops the
request and counts it); a writer thread of the recorder's own hashes the
keys and writes the JSON lines. At most ``max_requests`` are recorded, so
the file stays bounded too.

The format is the Mooncake FAST'25 one: ``timestamp`` in ms since the first
request, ``input_length`` (``len(keys) * block_tokens``), ``output_length``
(0: the Offloader never sees it) and ``hash_ids``, one 53-bit integer per
key (BLAKE2b of the key; 53 bits so every JSON reader keeps it exact). The
file is created new, owner-only, never through a symbolic link.

    async with TraceRecorder("traffic.jsonl", block_tokens=512) as recorder:
        offloader.recorder = recorder
        ...                                  # serve traffic
    # then: aiokvo replay traffic.jsonl --policy all
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from types import TracebackType
from typing import Self, TextIO

from aiokvo._util import check_int
from aiokvo.errors import ConfigError, UnsafeFileError
from aiokvo.keys import OffloadKey
from aiokvo.memory.ownership import open_private

__all__ = ["RecorderStatistics", "TraceRecorder", "hash_id"]


def hash_id(key: bytes) -> int:
    """The trace id of ``key``: 53 bits of its BLAKE2b digest."""
    return int.from_bytes(blake2b(key, digest_size=8).digest(), "big") >> 11


@dataclass(frozen=True, slots=True)
class RecorderStatistics:
    """A snapshot of a :class:`TraceRecorder`."""

    recorded: int  # requests accepted into the buffer
    written: int  # requests written to the file
    dropped: int  # requests dropped: buffer full, limit reached, or closed
    buffered: int  # requests waiting for the writer


class TraceRecorder:
    """Writes one trace line per request the Offloader serves (see the module docstring).

    ``max_requests`` bounds the file, ``buffer`` the requests waiting for
    the writer thread, which wakes every ``interval`` seconds (or as soon as
    the buffer is half full). Use it as a (sync or async) context manager,
    or call :meth:`open` and :meth:`close`; requests offered before
    ``open`` or after ``close`` are dropped.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_requests: int = 1_000_000,
        buffer: int = 8192,
        block_tokens: int = 0,
        interval: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.max_requests = check_int("max_requests", max_requests, minimum=1)
        self._capacity = check_int("buffer", buffer, minimum=1)
        self.block_tokens = check_int("block_tokens", block_tokens, minimum=0)
        if not interval > 0:
            raise ConfigError(f"interval must be positive, got {interval!r}")
        self._interval = interval
        self._clock = clock
        self._queue: deque[tuple[float, tuple[OffloadKey, ...]]] = deque()
        self._wake = threading.Event()
        self._open = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._file: TextIO | None = None
        self._first: float | None = None
        self._recorded = self._written = self._dropped = 0
        self._error: BaseException | None = None

    # -- the hook the Offloader calls ------------------------------------------

    def __call__(self, keys: Sequence[OffloadKey]) -> None:
        """One request's keys, in prefix order: buffer them (O(1) plus a tuple copy)."""
        if not self._open or self._recorded >= self.max_requests:
            self._dropped += 1
            return
        queue = self._queue
        if len(queue) >= self._capacity:
            self._dropped += 1
            return
        queue.append((self._clock(), tuple(keys)))
        self._recorded += 1
        if len(queue) * 2 >= self._capacity:
            self._wake.set()

    # -- lifecycle ---------------------------------------------------------------

    def open(self) -> None:
        """Create the file (it must not exist) and start the writer thread."""
        if self._open or self._closed:
            raise ConfigError(f"{self!r} was already opened")
        try:
            fd = open_private(self.path, how="create")
        except FileExistsError:
            if self.path.is_symlink():
                raise UnsafeFileError(f"{self.path} is a symbolic link; refusing it") from None
            raise ConfigError(f"{self.path} exists; a trace recorder makes a new file") from None
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._thread = threading.Thread(target=self._run, name="aiokvo-trace-recorder",
                                        daemon=True)  # fmt: skip
        self._open = True
        self._thread.start()

    def close(self) -> None:
        """Stop taking requests, write every buffered one, close the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        was_open, self._open = self._open, False
        if not was_open:
            return
        self._wake.set()
        assert self._thread is not None and self._file is not None
        self._thread.join()
        try:
            if self._error is None:
                self._drain(self._file)  # what a racing call added after the last drain
        finally:
            self._file.close()
        if self._error is not None:
            raise self._error

    async def aclose(self) -> None:
        """:meth:`close` on a thread, so the loop goes on meanwhile."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        self.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def statistics(self) -> RecorderStatistics:
        """How many requests were recorded, written and dropped so far."""
        return RecorderStatistics(
            recorded=self._recorded,
            written=self._written,
            dropped=self._dropped,
            buffered=len(self._queue),
        )

    def __repr__(self) -> str:
        state = "open" if self._open else "closed" if self._closed else "new"
        return f"<TraceRecorder {str(self.path)!r} {state}>"

    # -- the writer thread ---------------------------------------------------------

    def _run(self) -> None:
        out = self._file
        assert out is not None
        try:
            while True:
                self._wake.wait(self._interval)
                self._wake.clear()
                stopping = not self._open
                self._drain(out)
                if stopping:
                    return
        except BaseException as exc:  # reported by close()
            self._error = exc

    def _drain(self, out: TextIO) -> None:
        queue, tokens = self._queue, self.block_tokens
        lines = []
        while queue:
            at, keys = queue.popleft()
            if self._first is None:
                self._first = at
            lines.append(json.dumps({
                "timestamp": round(1000 * (at - self._first)),
                "input_length": tokens * len(keys),
                "output_length": 0,
                "hash_ids": [hash_id(key) for key in keys],
            }))  # fmt: skip
        if lines:
            out.write("\n".join(lines) + "\n")
            out.flush()
            self._written += len(lines)
