"""Helpers for the telemetry tests: scrape an endpoint, parse it, run a known workload."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from aiokvo import Offloader
from tests.offloader._harness import KV, keys

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def scrape(url: str) -> str:
    """GET the endpoint from another thread, as Prometheus would (the loop stays free)."""

    def get() -> str:
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
            return response.read().decode()

    return await asyncio.to_thread(get)


async def known_workload(off: Offloader, kv: KV) -> None:
    """4 stored, a 6-key lookup hitting 4, then 8 more stored into an 8-block pool."""
    ks = keys(*"abcdefghijkl")
    kv.write(range(4), ks[:4])
    assert (await off.store(ks[:4], [0, 1, 2, 3])).ok
    assert await off.load_prefix(ks[:6], [10, 11, 12, 13, 14, 15]) == 4
    result = await off.store(ks[4:], list(range(20, 28)))
    assert len(result.stored) == 8 and len(result.evicted) == 4


