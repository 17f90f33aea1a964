"""A slow or silent Mooncake master never holds up the event loop or the CPU pool,
and a master address with a port outside 1..65535 is refused up front."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from aiokvo import Offloader
from aiokvo.errors import ConfigError
from aiokvo.testing import require_mooncake
from aiokvo.tiers.mooncake import MooncakeTier, MooncakeTierConfig
from tests.offloader._harness import KV, keys


@pytest.fixture
def silent_master() -> Iterator[str]:
    """A TCP listener on loopback that accepts connections and never answers: a master
    whose RPCs hang (Mooncake's ``setup()`` then waits out its RPC deadline)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    host, port = server.getsockname()
    yield f"{host}:{port}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.system
async def test_a_silent_master_holds_up_neither_the_loop_nor_the_first_call(
    silent_master: str,
) -> None:
    require_mooncake()
    kv = KV()
    tier = MooncakeTier(
        silent_master, model_id="m", local_hostname="127.0.0.1", lookup_timeout=0.5,
        setup_timeout=120.0, rpc_timeout=30.0, io_timeout=2.0,
    )  # fmt: skip
    ticks = 0
    gaps: list[float] = []

    async def ticker() -> None:
        nonlocal ticks
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last, ticks = now, ticks + 1

    running = asyncio.ensure_future(ticker())
    off = Offloader(kv.config(8), kv.caches, tiers=[tier])
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    result = await off.store(ks, [0, 1])  # the first call opens the tiers
    assert result.ok
    (stats,) = off.statistics().tiers
    # The first call returned while the first connection attempt (up to 120 s against
    # a master that never answers) was still running: it did not wait for it.
    assert not stats.connected and stats.connect_failures == 0
    assert await off.load_prefix(ks, [2, 3]) == 2  # the CPU pool serves meanwhile
    await asyncio.sleep(0.2)
    assert ticks > 5 and max(gaps) < 10  # the loop kept running throughout
    await asyncio.wait_for(off.aclose(), 60)  # kills the probing child: no 120 s wait
    running.cancel()
    deadline = time.monotonic() + 60
    while any(t.name.startswith("aiokvo-mooncake") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the tier's threads outlived its close"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:99999"])
def test_a_master_port_outside_the_tcp_range_is_refused(address: str) -> None:
    with pytest.raises(ConfigError, match="port"):
        MooncakeTierConfig(master_server_addr=address, model_id="m")
    with pytest.raises(ConfigError, match="port"):
        MooncakeTierConfig(master_server_addr="127.0.0.1:5", model_id="m",
                           metadata_server=f"http://{address}/metadata")  # fmt: skip
