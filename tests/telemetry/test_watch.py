"""``python -m aiokvo.telemetry watch``, end to end against a real metrics server and publisher.

The watcher runs as its own process (as a user runs it), with a duration
limit; the Offloader's loop stays free meanwhile, so it answers the scrapes.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import sys

import pytest

from aiokvo import Offloader
from aiokvo.telemetry import cli
from aiokvo.telemetry.kv_events import KVEventPublisher
from aiokvo.telemetry.prometheus import start_metrics_server
from aiokvo.telemetry.watch import watch
from tests.offloader._harness import KV, Copies, keys
from tests.telemetry.scrape import known_workload


async def run_watch(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiokvo.telemetry", "watch", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


@pytest.mark.system
async def test_watch_scrapes_a_metrics_endpoint_and_prints_plain_lines_when_piped(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    async with start_metrics_server(off, 0) as server:
        await known_workload(off, kv)
        # Frames every 0.2 s for 2 s: the two this checks, with a second and more
        # of slack for a loaded machine's scrapes.
        rc, out = await run_watch("--metrics", server.url, "--interval", "0.2",
                                  "--duration", "2")
    assert rc == 0, out
    lines = [line for line in out.splitlines() if " CPU " in line]
    assert len(lines) >= 2  # periodic, not one final frame
    assert "\x1b[" not in out  # no terminal codes into a pipe
    for line in lines:
        assert line.startswith("[")
        assert "(total 66.7%)" in line  # 4 of 6 blocks hit
        assert "pool 8/8 blocks (100.0%)" in line
        assert "stored 12  evicted 4" in line
        assert "hit      -" in line  # no lookups while it watched


@pytest.mark.system
async def test_watch_redraws_a_table_on_a_terminal(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    async with start_metrics_server(off, 0) as server:
        await known_workload(off, kv)
        rc, out = await run_watch("--metrics", server.url, "--interval", "0.2",
                                  "--duration", "2",
                                  env={"TTY_COMPATIBLE": "1", "COLUMNS": "120"})
    assert rc == 0, out
    assert "\x1b[" in out  # rich's cursor movements: the frame is redrawn in place
    assert "hit (all)" in out and "store GB/s" in out
    assert "8/8 (100%)" in out and "66.7%" in out
    assert out.count(f"aiokvo  {server.url}") >= 2  # several frames were drawn


@pytest.mark.system
async def test_watch_catches_up_from_the_replay_socket_then_follows_live_events(
    offloader: tuple[Offloader, KV, Copies],
) -> None:
    off, kv, _ = offloader
    async with KVEventPublisher(off, "tcp://127.0.0.1:0",
                                replay_endpoint="tcp://127.0.0.1:0") as publisher:
        await known_workload(off, kv)  # before the watcher exists: only a replay has it
        await publisher.flush()
        assert publisher.replay_endpoint is not None
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiokvo.telemetry", "watch", "--events", publisher.endpoint,
            "--replay", publisher.replay_endpoint, "--interval", "0.1", "--duration", "120",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        assert proc.stdout is not None
        try:
            first = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert " CPU " in first, first
            assert "stored 12  evicted 4" in first and "pool 8 blocks" in first
            # Live: store one more key at a time until the view shows all of them.
            # (A SUB misses what is sent before its subscription reaches the PUB;
            # the watcher replays any gap it sees in the sequence numbers.)
            stored, seen = 12, first
            for i in range(200):
                kv.write([40], keys(f"live{i}"))
                assert (await off.store(keys(f"live{i}"), [40])).ok
                stored += 1
                await publisher.flush()
                line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                seen = line
                if f"stored {stored}  evicted {stored - 8}" in line:
                    break
            assert f"stored {stored}  evicted {stored - 8}" in seen, seen
            assert "pool 8 blocks" in seen  # resident = stored - removed, by hash
        finally:
            proc.send_signal(signal.SIGINT)
            rest, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, rest.decode()


async def test_an_endpoint_that_goes_away_is_reported_and_the_view_goes_on() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    out = io.StringIO()
    url = f"http://127.0.0.1:{port}/metrics"
    # Two frames need two refused scrapes: 1 s leaves most of it as slack under load.
    assert await watch(metrics=[url], interval=0.05, duration=1.0, out=out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2
    assert all(url in line and "refused" in line for line in lines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["watch"], "--metrics"),
        (["watch", "--replay", "tcp://127.0.0.1:1"], "--replay needs --events"),
        (["watch", "--metrics", "ftp://x"], "http"),
        (["watch", "--events", "nowhere"], "ZMQ endpoint"),
        (["watch", "--metrics", "http://x", "--interval", "0"], "interval"),
        (["watch", "--metrics", "http://x", "--duration", "-1"], "duration"),
    ],
)
def test_bad_arguments_exit_with_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


async def test_watch_tells_a_user_pointed_at_a_connecting_publisher_what_is_wrong() -> None:
    """``KVEventPublisher(m, "tcp://127.0.0.1:PORT")`` connects (vLLM's rule), and so
    does ``watch --events`` at the same address: nothing ever arrives. The view says
    why, and the publisher's statistics say which way it went."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    kv = KV(8)
    async with Offloader(kv.config(8), kv.caches) as off, KVEventPublisher(off, endpoint) as pub:
        stats = pub.statistics()
        assert (stats.pub_mode, stats.pub_endpoint) == ("connect", endpoint)
        out = io.StringIO()
        assert await watch(events=endpoint, interval=0.2, duration=1.0, out=out) == 0
    text = out.getvalue()
    assert f"{endpoint}: nothing accepts connections there" in text, text
    assert "'tcp://*:PORT' or bind=True" in text
