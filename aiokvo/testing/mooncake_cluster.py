"""``LocalCluster``: a throwaway Mooncake cluster on loopback, for tests and the demo.

One ``mooncake_master`` (the binary inside the ``mooncake`` package) and
``nodes`` storage nodes (:mod:`aiokvo.testing.mooncake_node`, one process
each), everything on 127.0.0.1 and on free ports from the kernel's ephemeral
range, so several clusters run side by side and none collides with
Mooncake's fixed defaults (50051, 8080, 9003) or the ports its clients pick
(12300-17000). Metadata is ``P2PHANDSHAKE`` by default (nothing else to run;
the master is up in about 0.05 s) or the master's embedded HTTP server
(``metadata="http"``, about 1 s, and every process then needs
``MC_TCP_BIND_ADDRESS=127.0.0.1``: :attr:`LocalCluster.client_env`).

Readiness: the master's admin ``/health`` says ``service_ready``; each node
printed ``READY`` after its ``setup()`` returned, and the master lists every
node's segment. Everything is stopped by pid (:meth:`LocalCluster.stop`):
nodes SIGKILLed by default (their data is throwaway; a graceful ``close()``
takes seconds), the master SIGTERMed. Each child also dies with the thread
that started it (``PR_SET_PDEATHSIG``), so start clusters from a long-lived
thread (the main thread): a crashed test run leaves nothing behind. Logs go
to owner-only files in ``workdir`` (a private temporary directory, removed
on stop unless ``keep_workdir``); nothing else is written anywhere.

::

    with LocalCluster(nodes=2, segment_size=256 << 20) as cluster:
        tier = MooncakeTier(model_id="m", **cluster.tier_settings())
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from aiokvo._util import check_choice, check_int
from aiokvo.errors import ConfigError, TierUnavailableError
from aiokvo.memory.ownership import open_private

__all__ = ["LocalCluster", "StorageNode", "free_port", "master_binary"]

Metadata = Literal["p2p", "http"]

MIN_SEGMENT = 16 << 20
"""The smallest segment Mooncake's allocator takes (``setup()`` fails with -600 below)."""

QUIET_ENV: Mapping[str, str] = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
"""Children's logging: the master obeys glog's level, clients Mooncake's own."""

# Exec a program after asking the kernel to kill it with the thread that starts it
# (the pid is kept: execv replaces this interpreter).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def master_binary() -> str:
    """The ``mooncake_master`` executable shipped inside the ``mooncake`` package."""
    try:
        import mooncake
    except ImportError as exc:
        from aiokvo.tiers.mooncake.client import INSTALL_HINT

        raise ConfigError(f"{INSTALL_HINT}; importing it failed: {exc}") from exc
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not os.access(path, os.X_OK):
        raise ConfigError(f"mooncake_master is not executable at {path}")
    return str(path)


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (free now; racy, callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_get(url: str, timeout: float = 0.5) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return str(reply.read().decode())
    except (OSError, urllib.error.URLError, ValueError):
        return None


@dataclass(slots=True)
class StorageNode:
    """One storage-node process: ``name`` is its segment name in the cluster."""

    process: subprocess.Popen[bytes]
    name: str
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class LocalCluster:
    """A master and ``nodes`` storage nodes on loopback; see the module docstring.

    ``segment_size`` bytes per node (at least 16 MiB); ``lease_ttl`` (seconds) the master's read
    lease, ``client_ttl`` (whole seconds) how long a silent client keeps its
    segments, ``eviction_high_watermark`` when the master starts evicting;
    ``master_args`` more ``mooncake_master`` flags; ``env`` more environment
    for every child.
    """

    def __init__(
        self,
        nodes: int = 1,
        *,
        segment_size: int = 256 << 20,
        metadata: Metadata = "p2p",
        lease_ttl: float | None = None,
        client_ttl: int | None = None,
        eviction_high_watermark: float | None = None,
        master_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        keep_workdir: bool = False,
        start_timeout: float = 30.0,
        python: str = sys.executable,
    ) -> None:
        self.num_nodes = check_int("nodes", nodes, minimum=0)
        self.segment_size = check_int("segment_size", segment_size, minimum=MIN_SEGMENT)
        self.metadata: Metadata = check_choice("metadata", metadata, ("p2p", "http"))
        flags = list(master_args)
        if lease_ttl is not None:
            flags.append(f"--default_kv_lease_ttl={max(1, round(lease_ttl * 1000))}ms")
        if client_ttl is not None:
            flags.append(f"--client_ttl={check_int('client_ttl', client_ttl, minimum=1)}")
        if eviction_high_watermark is not None:
            flags.append(f"--eviction_high_watermark_ratio={float(eviction_high_watermark)}")
        self.master_args = flags
        self._extra_env = dict(env or {})
        self._own_workdir = workdir is None
        self._workdir = None if workdir is None else Path(workdir)
        self.keep_workdir = keep_workdir
        self.start_timeout = start_timeout
        self.python = python
        self.rpc_port = self.http_port = self.admin_port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.nodes: list[StorageNode] = []
        self._started = False
        self._failed = False
        self._logs = 0

    # ------------------------------------------------------------ addresses
    @property
    def master_server_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """What clients pass as ``metadata_server``."""
        if self.metadata == "p2p":
            return "P2PHANDSHAKE"
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def admin_url(self) -> str:
        """The master's admin HTTP server (``/health``, ``/metrics``, ``/get_all_keys``)."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def client_env(self) -> dict[str, str]:
        """Environment every process of the cluster, clients included, needs before its
        ``setup()``: Mooncake's TCP transport listens on every interface unless told
        an address, and this cluster is loopback only."""
        return {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise ConfigError("the cluster is not started")
        return self._workdir

    def tier_settings(self) -> dict[str, Any]:
        """Keywords for :class:`~aiokvo.tiers.mooncake.MooncakeTier` (or its config)."""
        return {
            "master_server_addr": self.master_server_addr,
            "metadata_server": self.metadata_server,
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
        }

    # ------------------------------------------------------------- lifecycle
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> Self:
        """Start the master and the nodes; raises TierUnavailableError naming the log."""
        if self._started:
            return self
        self._started = True
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="aiokvo-mooncake-"))
        try:
            for attempt in range(3):  # free_port() is racy: new ports on a collision
                self.rpc_port, self.http_port, self.admin_port = (
                    free_port(), free_port(), free_port(),
                )  # fmt: skip
                try:
                    self.start_master()
                    break
                except TierUnavailableError:
                    if attempt == 2:
                        raise
            for _ in range(self.num_nodes):
                self.add_node()
            self.wait_for_segments(self.num_nodes)
        except BaseException:
            self._failed = True
            self.stop()
            raise
        return self

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(QUIET_ENV)
        env.update(self.client_env)
        env.update(self._extra_env)
        return env

    def _log(self, name: str) -> tuple[int, Path]:
        self._logs += 1
        path = self.workdir / f"{self._logs:03d}-{name}.log"
        return open_private(path, how="create"), path

    def start_master(self) -> None:
        """Start (or restart, on the same ports) the master and wait until it serves."""
        if self.master is not None and self.master.poll() is None:
            return
        http = [] if self.metadata == "p2p" else [
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
        ]  # fmt: skip
        args = [
            master_binary(), *http,
            "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.admin_port}",
            *self.master_args,
        ]  # fmt: skip
        fd, log = self._log("master")
        try:
            self.master = subprocess.Popen(
                [self.python, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args],
                cwd=self.workdir, env=self._env(), stdin=subprocess.DEVNULL,
                stdout=fd, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(fd)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.master.poll() is not None:
                raise TierUnavailableError(
                    f"mooncake_master exited with {self.master.returncode}; see {log}"
                )
            if self.master_ready():
                return
            time.sleep(0.02)
        raise TierUnavailableError(
            f"mooncake_master not ready in {self.start_timeout} s; see {log}"
        )

    def master_ready(self) -> bool:
        """The master's admin server says it serves."""
        text = _http_get(self.admin_url + "/health")
        try:
            return bool(text) and bool(json.loads(text or "{}").get("service_ready"))
        except ValueError:
            return False

    def stop_master(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop the master with ``sig`` (SIGKILL: a crash) and wait for it."""
        if self.master is not None:
            _signal(self.master, sig)
            _wait(self.master, 10.0)

    def add_node(self, segment_size: int | None = None) -> StorageNode:
        """Start one more storage node (``segment_size`` bytes) and wait for it."""
        size = self.segment_size if segment_size is None else segment_size
        fd, log = self._log(f"node{len(self.nodes)}")
        try:
            process = subprocess.Popen(
                [
                    self.python, "-m", "aiokvo.testing.mooncake_node",
                    "--master", self.master_server_addr, "--metadata", self.metadata_server,
                    "--segment-size", str(size), "--die-with-parent", str(os.getpid()),
                ],
                cwd=self.workdir, env=self._env(), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=fd, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(fd)
        try:
            name = self._ready_line(process, log)
        except BaseException:
            _signal(process, signal.SIGKILL)
            _wait(process, 10.0)
            raise
        node = StorageNode(process, name, log)
        self.nodes.append(node)
        return node

    def _ready_line(self, process: subprocess.Popen[bytes], log: Path) -> str:
        assert process.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        line = b""
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TierUnavailableError(f"storage node not ready; see {log}")
                if selector.select(min(left, 0.5)):
                    chunk = os.read(process.stdout.fileno(), 4096)
                    if not chunk:
                        _wait(process, 5.0)
                        raise TierUnavailableError(
                            f"storage node exited with {process.returncode}; see {log}"
                        )
                    line += chunk
        text = line.decode(errors="replace").strip()
        if not text.startswith("READY "):
            raise TierUnavailableError(f"storage node said {text!r}; see {log}")
        return text.split(" ", 1)[1]

    def kill_node(self, node: StorageNode, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop ``node`` with ``sig`` (SIGKILL: a crash) and wait for it."""
        _signal(node.process, sig)
        _wait(node.process, 30.0)

    def wait_for_segments(self, n: int, timeout: float = 15.0) -> None:
        """Until the master lists at least ``n`` segments (nodes re-mount after a restart)."""
        deadline = time.monotonic() + timeout
        while len(self.segments()) < n:
            if time.monotonic() > deadline:
                raise TierUnavailableError(
                    f"the master lists {len(self.segments())} segments, expected {n}"
                )
            time.sleep(0.02)

    def stop(self, *, graceful: bool = False) -> None:
        """Stop every process by pid: nodes (SIGKILL, or SIGTERM with ``graceful``), then
        the master (SIGTERM, SIGKILL after 5 s). Idempotent."""
        for node in self.nodes:
            _signal(node.process, signal.SIGTERM if graceful else signal.SIGKILL)
        for node in self.nodes:
            if not _wait(node.process, 5.0):
                _signal(node.process, signal.SIGKILL)
                _wait(node.process, 10.0)
            if node.process.stdout is not None:
                node.process.stdout.close()
        if self.master is not None:
            _signal(self.master, signal.SIGTERM)
            if not _wait(self.master, 5.0):
                _signal(self.master, signal.SIGKILL)
                _wait(self.master, 10.0)
        if (
            self._own_workdir
            and self._workdir is not None
            and not self.keep_workdir
            and not self._failed
        ):
            shutil.rmtree(self._workdir, ignore_errors=True)

    # ---------------------------------------------------------------- admin
    def segments(self) -> list[str]:
        """Segment names the master has mounted now."""
        text = _http_get(self.admin_url + "/get_all_segments")
        return [] if not text else text.split()

    def keys(self) -> list[str]:
        """Every object name the master holds now."""
        text = _http_get(self.admin_url + "/get_all_keys")
        return [] if not text else [k for k in text.split("\n") if k]

    def metric(self, name: str) -> float | None:
        """One value from the master's Prometheus ``/metrics`` (e.g. ``master_key_count``)."""
        for line in (_http_get(self.admin_url + "/metrics") or "").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def __repr__(self) -> str:
        state = "running" if self.master is not None and self.master.poll() is None else "stopped"
        return f"<LocalCluster {self.master_server_addr} {len(self.nodes)} nodes {state}>"


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)


def _wait(process: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return True
