"""Ask a Mooncake master whether it answers, from another process, before ``setup()``.

Mooncake's ``setup()`` (and ``close()``) hold the GIL for as long as they
take (the binding releases it only around the data calls), so an in-process
``setup()`` against a master that accepts connections but does not answer
stalls every Python thread, the event loop included, for Mooncake's whole
RPC deadline. The tier therefore first runs the same ``setup()`` in a
short-lived child process (``python -m aiokvo.tiers.mooncake.probe``, a pure
client that lends no memory and exits at once), and calls its own
``setup()`` only once the child got an answer: a slow or silent master costs
a child process, never the loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict

from aiokvo.errors import TierUnavailableError
from aiokvo.tiers.mooncake.config import SetupSettings

__all__ = ["SetupProbe", "main"]

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
                [sys.executable, "-m", "aiokvo.tiers.mooncake.probe", json.dumps(probe)],
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


def main(argv: Sequence[str] | None = None) -> int:
    """The child: one ``setup()`` and ``close()`` with the settings in ``argv[0]`` (JSON)."""
    args = list(sys.argv[1:] if argv is None else argv)
    settings = json.loads(args[0])
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        settings["local_hostname"], settings["metadata_server"],
        settings["global_segment_size"], settings["local_buffer_size"],
        settings["protocol"], settings["rdma_devices"], settings["master_server_addr"],
        None, settings["enable_ssd_offload"], settings["ssd_offload_path"],
        settings["tenant_id"], settings["enable_client_http_server"],
        settings["client_http_port"],
    )  # fmt: skip
    if rc != 0:
        print(f"setup() returned {rc}", flush=True)
        return 3
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
