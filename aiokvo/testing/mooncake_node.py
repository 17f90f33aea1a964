"""A Mooncake storage node: a process that lends memory to the cluster and holds objects.

Run: ``python -m aiokvo.testing.mooncake_node --master HOST:PORT --segment-size BYTES``
(``--metadata`` ``P2PHANDSHAKE`` by default, ``--hostname`` the address peers
dial). It calls Mooncake's ``setup()`` with a global segment of that size,
prints ``READY <segment name>`` on stdout once the segment is mounted at the
master, and serves until SIGTERM or SIGINT, when it closes the store (its
objects leave the cluster with it). A failed ``setup()`` prints
``SETUP_FAILED <code>`` and exits 2.

:class:`~aiokvo.testing.mooncake_cluster.LocalCluster` starts these for tests
and the demo; on a real cluster, a host that lends memory runs one (or
Mooncake's own ``mooncake_client``), see docs/tiers.md.

With ``--die-with-parent`` the node asks the kernel to kill it when the
process that started it dies (``PR_SET_PDEATHSIG``), so a crashed test run
leaves no node behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence

__all__ = ["die_with_parent", "main"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux), or now if
    ``parent`` is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", required=True, help="the master's HOST:PORT")
    parser.add_argument("--metadata", default="P2PHANDSHAKE", help="metadata server")
    parser.add_argument("--segment-size", type=int, required=True, help="bytes lent")
    parser.add_argument("--local-buffer-size", type=int, default=16 << 20)
    parser.add_argument("--hostname", default="127.0.0.1", help="the address peers dial")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--rdma-devices", default="")
    parser.add_argument("--die-with-parent", type=int, default=None, metavar="PID")
    args = parser.parse_args(argv)
    if args.die_with_parent is not None:
        die_with_parent(args.die_with_parent)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        args.hostname,
        args.metadata,
        args.segment_size,
        args.local_buffer_size,
        args.protocol,
        args.rdma_devices,
        args.master,
    )
    if rc != 0:
        print(f"SETUP_FAILED {rc}", flush=True)
        return 2
    print(f"READY {store.get_hostname()}", flush=True)
    os.dup2(2, 1)  # anything printed later goes to the log, not to the launcher's pipe
    while not stop.wait(0.5):
        pass
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
