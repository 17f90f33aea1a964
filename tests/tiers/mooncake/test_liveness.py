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


async def test_a_silent_master_holds_up_neither_the_loop_nor_the_first_call(
    silent_master: str,
) -> None:
    require_mooncake()
    kv = KV()
    tier = MooncakeTier(
        silent_master, model_id="m", local_hostname="127.0.0.1", lookup_timeout=0.5,
        setup_timeout=60.0, rpc_timeout=30.0, io_timeout=2.0,
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
    start = time.monotonic()
    ks = keys("a", "b")
    kv.write([0, 1], ks)
    result = await off.store(ks, [0, 1])  # the first call opens the tiers
    first_call = time.monotonic() - start
    assert result.ok
    assert await off.load_prefix(ks, [2, 3]) == 2  # the CPU pool serves meanwhile
    (stats,) = off.statistics().tiers
    assert not stats.connected
    assert first_call < 20  # not the 30 s RPC deadline nor the 60 s setup deadline
    await asyncio.sleep(0.2)
    assert ticks > 5 and max(gaps) < 10  # the loop kept running throughout
    await asyncio.wait_for(off.aclose(), 60)
    running.cancel()


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:99999"])
def test_a_master_port_outside_the_tcp_range_is_refused(address: str) -> None:
    with pytest.raises(ConfigError, match="port"):
        MooncakeTierConfig(master_server_addr=address, model_id="m")
    with pytest.raises(ConfigError, match="port"):
        MooncakeTierConfig(master_server_addr="127.0.0.1:5", model_id="m",
                           metadata_server=f"http://{address}/metadata")  # fmt: skip
