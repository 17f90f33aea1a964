"""``FaultyTier``: a tier that misbehaves on purpose, for your own Offloader's tests.

An in-memory :class:`~aiokvo.tiers.store.BlockStore` under the real tier
engine (:class:`~aiokvo.tiers.engine.StoreTier`): blocks are kept as bytes
with their xxh3 checksums, placed by a
:class:`~aiokvo.tiers.slot_index.SlotIndex` of ``capacity_blocks`` slots,
and the store injects the failures real tiers meet:

* **flipped bytes**: a block is kept with one byte flipped, so reading it
  back fails its checksum (``CORRUPT``: a miss, counted, the block dropped);
* **EIO**: a block's read or write fails (``IO_ERROR``: counts against the
  breaker);
* **stalls**: a transfer blocks past its deadline until :meth:`FaultyStore.
  release` (or ``stall_seconds``), as a hung disk or server does;
* **vanished objects**: a block is gone when read (``MISSING``).

Faults come from a :class:`Faults` plan: each kind a probability, drawn per
``(operation, key, occurrence)`` from a hash of ``seed``, so a run is the
same whatever the threads' timing; or one by one, on the keys a test names
(:meth:`FaultyStore.flip`, :meth:`~FaultyStore.fail`,
:meth:`~FaultyStore.vanish`, :meth:`~FaultyStore.stall`). :attr:`FaultyStore.
injected` counts what was injected, to compare with the tier's statistics::

    tier = FaultyTier(capacity_blocks=64, faults=Faults(seed=7, flip=0.05, eio=0.01))
    async with Offloader(config, kv, tiers=[tier]) as off:
        ...  # every load still byte-exact; misses where the tier failed
"""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokvo.errors import ConfigError, TierChecksumError, TierTimeoutError
from aiokvo.keys import OffloadKey
from aiokvo.tiers.base import TierStatistics
from aiokvo.tiers.checksum import xxh3
from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.index import Index
from aiokvo.tiers.outcome import Outcome
from aiokvo.tiers.settings import TierSettings
from aiokvo.tiers.slot_index import Adoption, BlockLocation, SlotIndex
from aiokvo.tiers.store import Apply, BlockJob, PoolRows, StoreBinding, StoreCapabilities

__all__ = ["FaultyStore", "FaultyTier", "Faults"]

Kind = str  # "flip", "eio", "stall", "vanish"
_KINDS = ("flip", "eio", "stall", "vanish")


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    """A seeded fault plan: the chance of each fault, per block (``stall``: per transfer).

    ``flip``: a block written is kept corrupt; ``eio``: a block's read or write
    fails with EIO; ``stall``: a transfer blocks past its deadline;
    ``vanish``: a block is gone when read.
    """

    seed: int = 0
    flip: float = 0.0
    eio: float = 0.0
    stall: float = 0.0
    vanish: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        for kind in _KINDS:
            p = getattr(self, kind)
            if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
                raise ConfigError(f"{kind} must be a probability in [0, 1], got {p!r}")

    def draws(self, kind: Kind, what: bytes, nth: int) -> bool:
        """Whether fault ``kind`` strikes the ``nth`` time ``what`` is seen (deterministic)."""
        p: float = getattr(self, kind)
        if p <= 0.0:
            return False
        digest = hashlib.blake2b(
            b"%d|%s|%d|" % (self.seed, kind.encode(), nth) + what, digest_size=8
        ).digest()
        return int.from_bytes(digest, "big") < p * 2.0**64


@dataclass(slots=True)
class _Kept:
    key: OffloadKey
    generation: int
    data: list[bytes]


class FaultyStore:
    """An in-memory :class:`~aiokvo.tiers.store.BlockStore` that injects faults; see the module.

    ``stall_seconds`` bounds a stall if the test never calls :meth:`release`.
    """

    statistics_type: type[TierStatistics] = TierStatistics
    capabilities = StoreCapabilities()

    def __init__(
        self,
        capacity_blocks: int,
        *,
        faults: Faults | None = None,
        medium: str = "FAULTY",
        stall_seconds: float = 60.0,
    ) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or (
            capacity_blocks < 1
        ):  # fmt: skip
            raise ConfigError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
        if not isinstance(medium, str) or not medium.isidentifier() or medium in ("CPU", "GPU"):
            raise ConfigError(f"medium must be a name of its own (not CPU or GPU), got {medium!r}")
        self.medium = medium
        self.capacity_blocks = capacity_blocks
        self.faults = faults if faults is not None else Faults()
        if not isinstance(self.faults, Faults):
            raise ConfigError(f"faults must be a Faults plan, got {faults!r}")
        self.stall_seconds = stall_seconds
        self.injected: Counter[str] = Counter()
        self.stalled = threading.Event()  # set while a transfer is stalled
        self._lock = threading.Lock()
        self._slots: dict[int, _Kept] = {}
        self._seen: Counter[tuple[str, bytes]] = Counter()
        self._planned: dict[tuple[Kind, OffloadKey], str] = {}
        self._stall_next = 0
        self._release = threading.Event()
        self._rows: PoolRows | None = None
        self.where = f"memory ({medium})"

    # -------------------------------------------------------------- controls
    def flip(self, key: OffloadKey) -> None:
        """Keep ``key``'s next write corrupt (a byte flipped after its checksum)."""
        self._plan("flip", key)

    def fail(self, key: OffloadKey, op: str = "read") -> None:
        """Fail ``key``'s next ``op`` (``"read"`` or ``"write"``) with EIO."""
        if op not in ("read", "write"):
            raise ConfigError(f"op must be 'read' or 'write', got {op!r}")
        self._plan(f"eio-{op}", key)

    def vanish(self, key: OffloadKey) -> None:
        """Make ``key``'s block gone now (its next read finds nothing)."""
        with self._lock:
            for slot, kept in list(self._slots.items()):
                if kept.key == key:
                    del self._slots[slot]
                    self.injected["vanish"] += 1

    def stall(self, transfers: int = 1) -> None:
        """Stall the next ``transfers`` transfers (either way) until :meth:`release`."""
        with self._lock:
            self._stall_next += transfers
            self._release.clear()

    def release(self) -> None:
        """Let every stalled transfer go on (and any stalled later)."""
        self._release.set()

    def holds(self, key: OffloadKey) -> bool:
        """Whether the store keeps a block of ``key`` (whatever the index thinks)."""
        with self._lock:
            return any(kept.key == key for kept in self._slots.values())

    def _plan(self, kind: str, key: OffloadKey) -> None:
        if not isinstance(key, bytes):
            raise ConfigError(f"key must be an OffloadKey, got {key!r}")
        with self._lock:
            self._planned[(kind, key)] = kind

    def _strikes(self, kind: str, planned: str, key: OffloadKey) -> bool:
        """A planned fault (taken once), else the plan's draw for this occurrence."""
        with self._lock:
            if self._planned.pop((planned, key), None) is not None:
                hit = True
            else:
                nth = self._seen[(planned, key)]
                self._seen[(planned, key)] = nth + 1
                hit = self.faults.draws(kind, planned.encode() + b"|" + bytes(key), nth)
            if hit:
                self.injected[planned] += 1
            return hit

    def _maybe_stall(self, job: BlockJob, what: str) -> None:
        with self._lock:
            if self._stall_next > 0:
                self._stall_next -= 1
                hit = True
            else:
                nth = self._seen[("stall", b"")]
                self._seen[("stall", b"")] = nth + 1
                hit = self.faults.draws("stall", what.encode(), nth)
            if hit:
                self.injected["stall"] += 1
        if hit:
            self.stalled.set()
            try:
                self._release.wait(self.stall_seconds)
            finally:
                self.stalled.clear()

    # ---------------------------------------------------------- the store
    def row_tail_bytes(self, kv_caches: object, config: object) -> int:
        return 0

    def bind(self, binding: StoreBinding) -> Index:
        self._rows = binding.rows
        return SlotIndex(self.capacity_blocks, medium=self.medium, sink=binding.sink)

    def open(self) -> Adoption:
        return Adoption(0)

    def write(self, job: BlockJob) -> None:
        rows = self._rows
        assert rows is not None
        self._maybe_stall(job, "write")
        outcomes = job.outcomes
        for i, key in enumerate(job.keys):
            if job.late():
                outcomes.fail_rest(Outcome.TIMEOUT, TierTimeoutError("past the deadline"))
                return
            where: BlockLocation = job.where[i]
            if self._strikes("eio", "eio-write", key):
                outcomes.fail(i, Outcome.IO_ERROR, OSError(errno.EIO, "injected EIO"), "eio")
                continue
            buffers = rows.buffers(job.groups[i], job.rows[i])
            outcomes.checksums[i] = xxh3(buffers)
            data = [bytes(b) for b in buffers]
            if self._strikes("flip", "flip", key) and data and data[0]:
                first = bytearray(data[0])
                first[len(first) // 2] ^= 0x40
                data[0] = bytes(first)
            with self._lock:
                self._slots[where.slot] = _Kept(key, where.generation, data)
            outcomes.ok(i)

    def read(self, job: BlockJob) -> None:
        rows = self._rows
        assert rows is not None
        self._maybe_stall(job, "read")
        outcomes = job.outcomes
        for i, key in enumerate(job.keys):
            if job.late():
                outcomes.fail_rest(Outcome.TIMEOUT, TierTimeoutError("past the deadline"))
                return
            where: BlockLocation = job.where[i]
            if self._strikes("eio", "eio-read", key):
                outcomes.fail(i, Outcome.IO_ERROR, OSError(errno.EIO, "injected EIO"), "eio")
                continue
            if self._strikes("vanish", "vanish-read", key):
                with self._lock:
                    self._slots.pop(where.slot, None)
            with self._lock:
                kept = self._slots.get(where.slot)
            if kept is None or kept.key != key or kept.generation != where.generation:
                outcomes.fail(i, Outcome.MISSING, KeyError(f"block {key.hex()} is gone"))
                continue
            buffers = rows.buffers(job.groups[i], job.rows[i])
            for buffer, data in zip(buffers, kept.data, strict=True):
                buffer[:] = data
            if xxh3(buffers) != where.checksum:
                outcomes.fail(i, Outcome.CORRUPT, TierChecksumError(
                    f"block {key.hex()} read back with another checksum"))  # fmt: skip
                continue
            outcomes.ok(i)

    def remove(self, places: list[Any]) -> None:
        with self._lock:
            for slot, generation in places:
                kept = self._slots.get(slot)
                if kept is not None and kept.generation == generation:
                    del self._slots[slot]

    def exists(self, places: list[Any]) -> list[int]:
        raise NotImplementedError("a FaultyStore answers lookups from its index")

    def probe(self) -> bool:
        return True

    def maintenance(self, index: Index) -> Callable[[], Apply] | None:
        return None

    def interrupt(self) -> None:
        """Nothing of a control call can hang here for long: nothing to do."""

    def close(self) -> None:
        self._release.set()
        with self._lock:
            self._slots.clear()

    def statistics_extra(self) -> dict[str, Any]:
        return {}


def FaultyTier(
    *,
    capacity_blocks: int,
    faults: Faults | None = None,
    medium: str = "FAULTY",
    stall_seconds: float = 60.0,
    model_id: str = "faulty",
    clock: Callable[[], float] = time.monotonic,
    **settings: Any,
) -> StoreTier:
    """A tier over a :class:`FaultyStore`; ``settings`` are
    :class:`~aiokvo.tiers.settings.TierSettings`' (``io_timeout``, ``admit_after``, ...)."""
    store = FaultyStore(
        capacity_blocks, faults=faults, medium=medium, stall_seconds=stall_seconds
    )
    return StoreTier(store, TierSettings.of(model_id=model_id, **settings), clock=clock)
