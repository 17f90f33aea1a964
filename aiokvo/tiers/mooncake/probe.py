"""Ask a Mooncake master whether it answers, from another process, before ``setup()``.

Mooncake's ``setup()`` (and ``close()``) hold the GIL for as long as they
take (the binding releases it only around the data calls), so an in-process
``setup()`` against a master that accepts connections but does not answer
stalls every Python thread, the event loop included, for Mooncake's whole
RPC deadline. The tier therefore first runs the same ``setup()`` in a
short-lived child process (a pure client that lends no memory and exits at
once), and calls its own
``setup()`` only once the child got an answer: a slow or silent master costs
a child process, never the loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict

from aiokvo.errors import TierUnavailableError
from aiokvo.tiers.mooncake.config import SetupSettings

__all__ = ["SetupProbe"]

_QUIET = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}


class SetupProbe:
    """Runs the probing child; :meth:`cancel` kills one in flight (the tier is closing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._cancelled = False

    def __call__(self, settings: SetupSettings, timeout: float) -> None:
        """Raise :class:`~aiokvo.errors.TierUnavailableError` unless a child process's
        ``setup()`` with ``settings`` succeeds within ``timeout`` seconds (blocking)."""
        probe = {**asdict(settings), "global_segment_size": 0,
                 "enable_client_http_server": False}  # fmt: skip
        env = {**os.environ, **_QUIET}
        env["MC_RPC_TIMEOUT_MS"] = str(max(1, round(timeout * 1000)))
        env["MC_STORE_CLIENT_SETUP_RETRIES"] = "1"
        with self._lock:
            if self._cancelled:
                raise TierUnavailableError("the Mooncake tier is closing")
            child = self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(probe)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            said, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise TierUnavailableError(
                f"the Mooncake master at {settings.master_server_addr} did not answer a "
                f"setup within {timeout} s"
            ) from None
        finally:
            with self._lock:
                self._child = None
        if child.returncode != 0:
            lines = said.decode(errors="replace").strip().splitlines()
            reason = "closing" if self._cancelled else (
                lines[-1] if lines else f"exit code {child.returncode}"
            )  # fmt: skip
            raise TierUnavailableError(
                f"the Mooncake master at {settings.master_server_addr} refused a setup "
                f"({reason})"
            )

    def cancel(self) -> None:
        """Kill the child in flight, and start no other."""
        with self._lock:
            self._cancelled = True
            child = self._child
        if child is not None:
            child.kill()


_CHILD = """
import json, os, sys
settings = json.loads(sys.argv[1])
from mooncake.store import MooncakeDistributedStore
rc = MooncakeDistributedStore().setup(
    settings["local_hostname"], settings["metadata_server"], 0,
    settings["local_buffer_size"], settings["protocol"], settings["rdma_devices"],
    settings["master_server_addr"], None, settings["enable_ssd_offload"],
    settings["ssd_offload_path"], settings["tenant_id"], False,
    settings["client_http_port"],
)
print(f"setup() returned {rc}", flush=True)
os._exit(0 if rc == 0 else 3)  # no close(): it takes a second, and the child is done
"""
"""The child's program: only Mooncake is imported (an interpreter and ``mooncake.store``
start in a fraction of a second), and it exits without ``close()``: a pure client with
no segment, which the master forgets after its ``client_ttl``."""
