"""An in-process stand-in for a Mooncake cluster, for tests without one.

:class:`FakeMooncakeCluster` holds objects in a dict and behaves the way the
real store was measured to (docs/tiers.md, "Failure behaviour"): a put of an
existing name succeeds without overwriting; a put that does not fit the
capacity is ``-200``; a missing object is ``-704``; a destination smaller than
the object is ``-600``. Its stores copy bytes with ``memmove`` between real
pointers and refuse memory that was not registered (as RDMA would), so the
tier's pointer math is checked too. What a real cluster does only under
failure can be injected: a dead master (every call ``-900``), a hung one
(calls block until released), objects that "exist" but cannot be read, bytes
corrupted in place, codes returned for chosen names.

``FakeMooncakeCluster.store`` is a ``store_factory`` for
:class:`~aiokvo.tiers.mooncake.MooncakeTier`. The real cluster runs in the
suite too (:mod:`aiokvo.testing.mooncake_cluster`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["FakeMooncakeCluster", "FakeMooncakeStore", "FakeReplicateConfig"]

RPC_FAIL = -900
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
NO_AVAILABLE_HANDLE = -200


@dataclass
class FakeReplicateConfig:
    """The fields of Mooncake's ``ReplicateConfig`` the tier sets."""

    replica_num: int = 1
    preferred_segment: str = ""


@dataclass
class _Calls:
    setup: int = 0
    exists: int = 0
    put: int = 0
    get: int = 0
    remove: int = 0
    close: int = 0
    names_asked: list[list[str]] = field(default_factory=list)
    buffers: list[int] = field(default_factory=list)  # buffers per object of each put/get


class FakeMooncakeCluster:
    """Objects by name, a capacity, and the failures a test injects."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        self.capacity_bytes = capacity_bytes
        self.objects: dict[str, bytes] = {}
        self.replicas: dict[str, int] = {}
        self.down = False  # every call answers RPC_FAIL, setup() fails
        self.setup_rc = 0
        self.hang = threading.Event()  # set: calls block until released
        self._release = threading.Event()
        self.stale: set[str] = set()  # exist, but every get is OBJECT_NOT_FOUND
        self.codes: dict[str, int] = {}  # name -> code its next get or put returns
        self.calls = _Calls()
        self.stores: list[FakeMooncakeStore] = []
        self._lock = threading.Lock()

    def store(self) -> FakeMooncakeStore:
        """A new store object of this cluster (a ``store_factory``)."""
        store = FakeMooncakeStore(self)
        self.stores.append(store)
        return store

    @property
    def used_bytes(self) -> int:
        return sum(len(b) for b in self.objects.values())

    def corrupt(self, name: str, offset: int = 0) -> None:
        """Flip one byte of object ``name`` in place."""
        data = bytearray(self.objects[name])
        data[offset] ^= 0xFF
        self.objects[name] = bytes(data)

    def block(self) -> None:
        """Make every call block (a hung master) until :meth:`unblock`."""
        self._release.clear()
        self.hang.set()

    def unblock(self) -> None:
        self.hang.clear()
        self._release.set()

    def _wait(self) -> None:
        if self.hang.is_set():
            self._release.wait()


class FakeMooncakeStore:
    """One client of a :class:`FakeMooncakeCluster`, with the real store's method names."""

    ReplicateConfig = FakeReplicateConfig

    def __init__(self, cluster: FakeMooncakeCluster) -> None:
        self.cluster = cluster
        self.is_setup = False
        self.closed = False
        self.setup_args: tuple[object, ...] = ()
        self.buffers: dict[int, int] = {}

    def _check(self) -> None:
        if self.closed:
            raise AssertionError("a Mooncake store was called after close() (a segfault)")
        if not self.is_setup:
            raise AssertionError("a Mooncake store was called before setup()")

    def _registered(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= start + n for start, n in self.buffers.items())

    # ---------------------------------------------------------------- setup
    def setup(self, *args: object) -> int:
        self.cluster.calls.setup += 1
        self.cluster._wait()
        if self.cluster.down or self.cluster.setup_rc:
            return self.cluster.setup_rc or -1
        self.setup_args = args
        self.is_setup = True
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        self._check()
        self.buffers[ptr] = size
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        self._check()
        return 0 if self.buffers.pop(ptr, None) is not None else INVALID_PARAMS

    def get_hostname(self) -> str:
        return "127.0.0.1:0"

    def close(self) -> int:
        self.cluster.calls.close += 1
        self.closed = True
        return 0

    # ----------------------------------------------------------------- data
    def batch_is_exist(self, names: list[str]) -> list[int]:
        self._check()
        cluster = self.cluster
        cluster.calls.exists += 1
        cluster.calls.names_asked.append(list(names))
        cluster._wait()
        if cluster.down:
            return [RPC_FAIL] * len(names)
        return [1 if n in cluster.objects else 0 for n in names]

    def batch_put_from(
        self, names: list[str], ptrs: list[int], sizes: list[int], config: object = None
    ) -> list[int]:
        """One buffer per object: the multi-buffer call's behaviour."""
        return self.batch_put_from_multi_buffers(
            names, [[p] for p in ptrs], [[n] for n in sizes], config
        )

    def batch_get_into(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """One buffer per object: the multi-buffer call's behaviour."""
        return self.batch_get_into_multi_buffers(names, [[p] for p in ptrs], [[n] for n in sizes])

    def batch_put_from_multi_buffers(
        self,
        names: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        config: object = None,
    ) -> list[int]:
        self._check()
        cluster = self.cluster
        cluster.calls.put += 1
        cluster.calls.buffers.extend(len(parts) for parts in ptrs)
        cluster._wait()
        if cluster.down:
            return [RPC_FAIL] * len(names)
        out = []
        replicas = int(getattr(config, "replica_num", 1))
        for name, parts, lengths in zip(names, ptrs, sizes, strict=True):
            code = cluster.codes.pop(name, None)
            if code is not None:
                out.append(code)
                continue
            if not all(self._registered(p, n) for p, n in zip(parts, lengths, strict=True)):
                out.append(INVALID_PARAMS)
                continue
            if name in cluster.objects:
                out.append(0)  # no overwrite
                continue
            total = sum(lengths)
            with cluster._lock:
                if cluster.used_bytes + total * replicas > cluster.capacity_bytes:
                    out.append(NO_AVAILABLE_HANDLE)
                    continue
                cluster.objects[name] = b"".join(
                    ctypes.string_at(p, n) for p, n in zip(parts, lengths, strict=True)
                )
                cluster.replicas[name] = replicas
            out.append(0)
        return out

    def batch_get_into_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        self._check()
        cluster = self.cluster
        cluster.calls.get += 1
        cluster.calls.buffers.extend(len(parts) for parts in ptrs)
        cluster._wait()
        if cluster.down:
            return [RPC_FAIL] * len(names)
        out = []
        for name, parts, lengths in zip(names, ptrs, sizes, strict=True):
            code = cluster.codes.pop(name, None)
            if code is not None:
                out.append(code)
                continue
            data = cluster.objects.get(name)
            if data is None or name in cluster.stale:
                out.append(OBJECT_NOT_FOUND)
                continue
            if not all(self._registered(p, n) for p, n in zip(parts, lengths, strict=True)):
                out.append(INVALID_PARAMS)
                continue
            if sum(lengths) < len(data):
                out.append(INVALID_PARAMS)
                continue
            offset = 0
            for p, n in zip(parts, lengths, strict=True):
                chunk = data[offset : offset + n]
                ctypes.memmove(p, chunk, len(chunk))
                offset += n
            out.append(len(data))
        return out

    def batch_remove(self, names: Iterable[str], force: bool = False) -> list[int]:
        self._check()
        cluster = self.cluster
        cluster.calls.remove += 1
        out = []
        for name in names:
            out.append(0 if cluster.objects.pop(name, None) is not None else OBJECT_NOT_FOUND)
            cluster.stale.discard(name)
        return out
