"""``MooncakeClient``: the one place the tier calls Mooncake, and never after ``close()``.

Mooncake's ``MooncakeDistributedStore`` is a C++ object whose methods
segfault once it is closed, and whose calls block (they release the GIL).
This wrapper is what the tier's threads call instead:

* every call counts itself in and out under a lock, and :meth:`close` waits
  for the calls in flight before closing the store (and leaves it open,
  logged, if one is stuck past ``close_timeout``: a leaked client beats a
  crashed engine); a call after :meth:`close` raises
  :class:`~aiokvo.errors.TierUnavailableError` instead of crashing;
* :meth:`connect` checks first that the master accepts TCP connections (a
  refused connection costs microseconds; Mooncake's ``setup()`` against a
  dead master retries for seconds), calls ``setup()``, and registers the CPU
  pool's memory once (the spans merged, so no byte is registered twice);
* Mooncake's own deadline and setup retries are environment variables read
  at ``setup()`` (``MC_RPC_TIMEOUT_MS``, ``MC_STORE_CLIENT_SETUP_RETRIES``):
  :func:`apply_env_defaults` sets them from the tier's config unless the
  environment already has them.

``store_factory`` makes the store (default: ``mooncake.store.MooncakeDistributedStore``);
:class:`~aiokvo.testing.mooncake_fake.FakeMooncakeStore` stands in for tests.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from aiokvo.errors import ConfigError, TierUnavailableError
from aiokvo.tiers.mooncake.config import SetupSettings

__all__ = [
    "MooncakeClient",
    "StoreFactory",
    "apply_env_defaults",
    "default_store_factory",
    "merge_spans",
    "route_address",
]

logger = logging.getLogger(__name__)

StoreFactory = Callable[[], Any]
"""Makes one (not yet set up) store object with Mooncake's Python API."""

INSTALL_HINT = (
    "the Mooncake tier needs Mooncake Store: pip install 'aiokvo[mooncake]' (CPU machines, "
    "mooncake-transfer-engine-non-cuda) or 'aiokvo[mooncake-cuda]' (CUDA machines), and the "
    "system libraries libibverbs1 libnuma1 libcurl4 (Debian: apt-get install -y libibverbs1 "
    "librdmacm1 libnuma1 libcurl4)"
)


def default_store_factory() -> Any:
    """A ``mooncake.store.MooncakeDistributedStore``, or a ConfigError saying what is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT}; importing it failed: {exc}") from exc
    return MooncakeDistributedStore()


def apply_env_defaults(*, rpc_timeout: float, setup_retries: int) -> dict[str, str]:
    """Set Mooncake's deadline and setup retries unless the environment has them;
    the values in force afterwards."""
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(rpc_timeout * 1000))))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(setup_retries))
    return {k: os.environ[k] for k in ("MC_RPC_TIMEOUT_MS", "MC_STORE_CLIENT_SETUP_RETRIES")}


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def route_address(master_server_addr: str) -> str:
    """The local address this host reaches the master from: what peers should dial.

    A UDP ``connect`` sends nothing; it only asks the kernel for the route.
    """
    host, port = split_address(master_server_addr)
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(where)
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def probe_master(master_server_addr: str, timeout: float) -> None:
    """Raise :class:`~aiokvo.errors.TierUnavailableError` unless the master accepts
    a TCP connection within ``timeout`` seconds."""
    host, port = split_address(master_server_addr)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise TierUnavailableError(
            f"the Mooncake master at {master_server_addr} does not accept connections: {exc}"
        ) from exc


def merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(address, length)`` spans merged where they overlap or touch, in address order."""
    merged: list[list[int]] = []
    for start, length in sorted((s, n) for s, n in spans if n > 0):
        end = start + length
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


class MooncakeClient:
    """A guarded Mooncake store: connect once, call from any thread, close once.

    ``replica_num`` and ``preferred_segment`` go into every put's
    ``ReplicateConfig``; ``probe`` checks the master is reachable before
    ``setup()`` (None: no check, for stand-ins without a master).
    """

    def __init__(
        self,
        store_factory: StoreFactory = default_store_factory,
        *,
        replica_num: int = 1,
        preferred_segment: str | None = None,
        probe: Callable[[str, float], None] | None = probe_master,
        setup_probe: Callable[[SetupSettings, float], None] | None = None,
        close_timeout: float = 60.0,
    ) -> None:
        self._factory = store_factory
        self._probe = probe
        self._setup_probe = setup_probe
        self._replica_num = replica_num
        self._preferred_segment = preferred_segment
        self._close_timeout = close_timeout
        self._lock = threading.Condition(threading.Lock())
        self._connecting = threading.Lock()  # one setup() at a time
        self._store: Any = None
        self._stuck: Any = None  # a store left open under a stuck call: kept alive
        self._replicate: Any = None
        self._calls = 0
        self._closing = False
        self.hostname = ""
        self.registered: list[tuple[int, int]] = []

    @property
    def closing(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._closing

    @property
    def connected(self) -> bool:
        return self._store is not None and not self._closing

    # ------------------------------------------------------------ connecting
    def connect(
        self, settings: SetupSettings, spans: Sequence[tuple[int, int]], *,
        probe_timeout: float, setup_timeout: float = 30.0,
    ) -> None:  # fmt: skip
        """``setup()`` and register ``spans``; raises TierUnavailableError (blocking).

        The master is probed first: its TCP port within ``probe_timeout``, then
        (``setup_probe``) a whole ``setup()`` in a child process within
        ``setup_timeout``, because ``setup()`` holds the GIL while it waits.
        Concurrent calls wait for each other: the first that succeeds connects.
        """
        with self._connecting:
            self._connect(settings, spans, probe_timeout, setup_timeout)

    def _connect(
        self, settings: SetupSettings, spans: Sequence[tuple[int, int]], probe_timeout: float,
        setup_timeout: float,
    ) -> None:  # fmt: skip
        with self._lock:
            if self._closing:
                raise TierUnavailableError("the Mooncake client is closed")
            if self._store is not None:
                return
        if self._probe is not None:
            self._probe(settings.master_server_addr, probe_timeout)
        if self._setup_probe is not None:
            self._setup_probe(settings, setup_timeout)
        store = self._factory()
        rc = store.setup(
            settings.local_hostname,
            settings.metadata_server,
            settings.global_segment_size,
            settings.local_buffer_size,
            settings.protocol,
            settings.rdma_devices,
            settings.master_server_addr,
            None,
            settings.enable_ssd_offload,
            settings.ssd_offload_path,
            settings.tenant_id,
            settings.enable_client_http_server,
            settings.client_http_port,
        )
        if rc != 0:
            # A store whose setup failed was never set up: close() is safe on it.
            _close_quietly(store)
            raise TierUnavailableError(
                f"Mooncake setup() returned {rc} (master {settings.master_server_addr}, "
                f"metadata {settings.metadata_server}, as {settings.local_hostname})"
            )
        registered: list[tuple[int, int]] = []
        for start, length in merge_spans(spans):
            rc = store.register_buffer(start, length)
            if rc != 0:
                _close_quietly(store)
                raise TierUnavailableError(
                    f"Mooncake register_buffer({start:#x}, {length}) returned {rc}"
                )
            registered.append((start, length))
        replicate = self._make_replicate(store)
        with self._lock:
            if self.closing:  # closed while we were connecting
                _close_quietly(store)
                raise TierUnavailableError("the Mooncake client is closed")
            self._store, self._replicate = store, replicate
            self.hostname = str(store.get_hostname())
            self.registered = registered

    def _make_replicate(self, store: Any) -> Any:
        make: Any = getattr(store, "ReplicateConfig", None)
        if make is None:
            from mooncake.store import ReplicateConfig

            make = ReplicateConfig
        config = make()
        config.replica_num = self._replica_num
        if self._preferred_segment is not None:
            config.preferred_segment = self._preferred_segment
        return config

    # ----------------------------------------------------------------- calls
    def _enter(self) -> Any:
        with self._lock:
            store = self._store
            if store is None or self._closing:
                raise TierUnavailableError("the Mooncake client is not connected")
            self._calls += 1
            return store

    def _exit(self) -> None:
        with self._lock:
            self._calls -= 1
            if not self._calls:
                self._lock.notify_all()

    def exists(self, names: list[str]) -> list[int]:
        """``batch_is_exist``: 1, 0 or a negative code per name."""
        store = self._enter()
        try:
            return list(store.batch_is_exist(names))
        finally:
            self._exit()

    def put(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """``batch_put_from_multi_buffers``: 0 or a negative code per object."""
        store = self._enter()
        try:
            return list(store.batch_put_from_multi_buffers(names, ptrs, sizes, self._replicate))
        finally:
            self._exit()

    def put_from(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``batch_put_from``: one buffer per object; 0 or a negative code per object."""
        store = self._enter()
        try:
            return list(store.batch_put_from(names, ptrs, sizes, self._replicate))
        finally:
            self._exit()

    def get_into(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``batch_get_into``: one buffer per object; bytes read or a negative code."""
        store = self._enter()
        try:
            return list(store.batch_get_into(names, ptrs, sizes))
        finally:
            self._exit()

    def get(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """``batch_get_into_multi_buffers``: bytes read or a negative code per object."""
        store = self._enter()
        try:
            return list(store.batch_get_into_multi_buffers(names, ptrs, sizes))
        finally:
            self._exit()

    def remove(self, names: list[str]) -> list[int]:
        """``batch_remove(force=True)``: objects holding wrong bytes go even while leased."""
        store = self._enter()
        try:
            return list(store.batch_remove(names, True))
        finally:
            self._exit()

    # --------------------------------------------------------------- closing
    def abandon(self, why: str) -> None:
        """Stop using the store without closing it (its ``close()`` holds the GIL for as
        long as a dead master takes to time out): it is kept alive, unused, and the
        process keeps running. Later calls raise TierUnavailableError."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._stuck, self._store = self._store, None
        if self._stuck is not None:
            logger.warning("Mooncake tier: leaving the client open, unused: %s", why)

    def close(self) -> None:
        """Wait for the calls in flight, then close the store once (blocking)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            store, self._store = self._store, None
            if store is None:
                return
            if not self._lock.wait_for(lambda: self._calls == 0, self._close_timeout):
                self._stuck = store  # its destructor must not run under the stuck call
                logger.error(
                    "Mooncake tier: %d calls still running after %.0f s; leaving the "
                    "store open rather than closing it under them",
                    self._calls, self._close_timeout,
                )  # fmt: skip
                return
        for start, _ in self.registered:
            try:
                store.unregister_buffer(start)
            except Exception as exc:  # closing anyway
                logger.warning("Mooncake tier: unregister_buffer failed: %r", exc)
        _close_quietly(store)


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception as exc:
        logger.warning("Mooncake tier: close() failed: %r", exc)
