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
from collections.abc import Sequence
from dataclasses import asdict

from aiokvo.errors import TierUnavailableError
from aiokvo.tiers.mooncake.config import SetupSettings

__all__ = ["main", "probe_setup"]

_QUIET = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}


def probe_setup(settings: SetupSettings, timeout: float) -> None:
    """Raise :class:`~aiokvo.errors.TierUnavailableError` unless a child process's
    ``setup()`` with ``settings`` succeeds within ``timeout`` seconds (blocking)."""
    probe = {**asdict(settings), "global_segment_size": 0, "enable_client_http_server": False}
    env = {**os.environ, **_QUIET}
    env["MC_RPC_TIMEOUT_MS"] = str(max(1, round(timeout * 1000)))
    env["MC_STORE_CLIENT_SETUP_RETRIES"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "aiokvo.tiers.mooncake.probe", json.dumps(probe)],
            env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise TierUnavailableError(
            f"the Mooncake master at {settings.master_server_addr} did not answer a setup "
            f"within {timeout} s"
        ) from None
    if done.returncode != 0:
        said = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
        raise TierUnavailableError(
            f"the Mooncake master at {settings.master_server_addr} refused a setup "
            f"({said[-1] if said else f'exit code {done.returncode}'})"
        )


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
