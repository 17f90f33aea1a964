"""MooncakeClient: one setup() however many threads connect, and no call after close()."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from aiokvo.errors import TierUnavailableError
from aiokvo.testing.mooncake_fake import FakeMooncakeCluster
from aiokvo.tiers.mooncake.client import MooncakeClient, merge_spans, route_address
from aiokvo.tiers.mooncake.config import MooncakeTierConfig

SETTINGS = MooncakeTierConfig(master_server_addr="127.0.0.1:1", model_id="m").setup_settings(
    "127.0.0.1"
)


def test_spans_are_merged_so_no_byte_is_registered_twice() -> None:
    assert merge_spans([(100, 50), (0, 10), (140, 20), (10, 5), (300, 0)]) == [
        (0, 15), (100, 60),
    ]  # fmt: skip


def test_the_route_to_a_loopback_master_is_loopback() -> None:
    assert route_address("127.0.0.1:50051") == "127.0.0.1"


def test_concurrent_connects_set_up_one_store_and_register_the_pool() -> None:
    cluster = FakeMooncakeCluster()
    client = MooncakeClient(cluster.store, probe=None)
    pool = np.zeros(1 << 16, dtype=np.uint8)
    spans = [(pool.ctypes.data, pool.nbytes // 2), (pool.ctypes.data + 100, pool.nbytes - 100)]
    threads = [
        threading.Thread(target=client.connect, args=(SETTINGS, spans), kwargs={"probe_timeout": 1})
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cluster.calls.setup == 1 and len(cluster.stores) == 1
    assert client.registered == [(pool.ctypes.data, pool.nbytes)]
    assert cluster.stores[0].setup_args[:7] == (
        "127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "127.0.0.1:1",
    )  # fmt: skip
    client.close()


def test_a_failed_setup_is_a_typed_error_and_closes_that_store() -> None:
    cluster = FakeMooncakeCluster()
    cluster.setup_rc = -1
    client = MooncakeClient(cluster.store, probe=None)
    with pytest.raises(TierUnavailableError, match="setup\\(\\) returned -1"):
        client.connect(SETTINGS, [], probe_timeout=1)
    assert cluster.stores[0].closed and not client.connected


def test_a_dead_master_is_refused_before_setup() -> None:
    cluster = FakeMooncakeCluster()
    client = MooncakeClient(cluster.store)  # probes 127.0.0.1:1: refused
    with pytest.raises(TierUnavailableError, match="does not accept connections"):
        client.connect(SETTINGS, [], probe_timeout=1)
    assert cluster.calls.setup == 0


def test_close_waits_for_a_call_in_flight_and_later_calls_raise() -> None:
    cluster = FakeMooncakeCluster()
    client = MooncakeClient(cluster.store, probe=None)
    client.connect(SETTINGS, [], probe_timeout=1)
    cluster.block()
    answers: list[list[int]] = []
    caller = threading.Thread(target=lambda: answers.append(client.exists(["x"])))
    caller.start()
    closer = threading.Thread(target=client.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and cluster.calls.close == 0  # waiting for the call
    cluster.unblock()
    closer.join()
    caller.join()
    assert answers == [[0]] and cluster.calls.close == 1
    with pytest.raises(TierUnavailableError):
        client.exists(["x"])  # would be a segfault on the real store
