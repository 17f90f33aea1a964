"""A scheduler's-eye tour of the offload manager, with a live event subscriber.

Run:  python examples/manager_tour.py

A four-block CPU pool, a "hot" two-block prompt prefix that requests share,
and a one-off scan of unrelated blocks that does not fit in what is left. The
same walk runs under LRU and ARC. Under LRU, the scan pushes the hot prefix
out. ARC promoted the prefix to its frequent list when it was reused, so the
prefix survives the scan. A subscriber task prints the manager's event
stream as it happens. There are no tensors here: the "copies" are a
``sleep(0)``, because the manager only decides where blocks go. Moving them is
the handlers' job (see examples/quickstart.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Sequence

from aiokvo.config import OffloadConfig
from aiokvo.events import EventSubscription, Lagged
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.base import OffloadingManager
from aiokvo.offloading_spec import CPUOffloadingSpec
from aiokvo.runtime.run import run
from aiokvo.specs import CPULoadStoreSpec, LoadStoreSpec, ReqContext

BLOCK_BYTES = 2 << 20  # KV bytes of one 16-token block, e.g. a small model on one GPU
POOL_BLOCKS = 4

NAMES: dict[OffloadKey, str] = {}


def block(name: str) -> OffloadKey:
    """The offload key of a named block (its hash stands in for a token-prefix hash)."""
    key = make_offload_key(hashlib.sha256(name.encode()).digest()[:16], 0)
    NAMES[key] = name
    return key


def names(keys: Sequence[OffloadKey]) -> str:
    return " ".join(NAMES[k] for k in keys) or "-"


def block_ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids]


def say(step: str, detail: str = "") -> None:
    print(f"  {step:<44} {detail}".rstrip())


async def print_events(events: EventSubscription) -> None:
    async for item in events:
        if isinstance(item, Lagged):
            print(f"      event: lagged, {item.missed} events missed")
        elif item.removed:
            print(f"      event: - evicted {names(item.keys)}")
        else:
            print(f"      event: + stored  {names(item.keys)}")


async def copy_finished() -> None:
    """Stand-in for awaiting a transfer; also lets the subscriber print."""
    await asyncio.sleep(0)


class Scheduler:
    """The calls a real scheduler makes per request, narrated."""

    def __init__(self, manager: OffloadingManager) -> None:
        self.manager = manager
        self.ctx = ReqContext()

    async def request(self, title: str, prompt: list[OffloadKey]) -> int:
        print(f"[{title}] prompt blocks: {names(prompt)}")
        hits = self.manager.lookup_prefix(prompt, self.ctx)
        assert hits is not None, "no store is in flight between requests here"
        say(f"lookup_prefix -> {hits} of {len(prompt)} offloaded")
        if hits:
            await self.load(prompt[:hits])
        if hits < len(prompt):
            await self.store(prompt[hits:])
        return hits

    async def load(self, keys: list[OffloadKey]) -> None:
        spec = self.manager.prepare_load(keys, self.ctx)
        say(f"prepare_load({names(keys)})", f"read CPU blocks {block_ids(spec)}")
        await copy_finished()
        self.manager.complete_load(keys)
        self.manager.touch(keys)
        say(f"complete_load + touch({names(keys)})")

    async def store(self, keys: list[OffloadKey]) -> None:
        out = self.manager.prepare_store(keys, self.ctx)
        if out is None:
            say(f"prepare_store({names(keys)})", "-> None: no room, nothing changed")
            return
        say(
            f"prepare_store({names(keys)})",
            f"write CPU blocks {block_ids(out.store_spec)}, evict {names(out.evicted_keys)}",
        )
        await asyncio.sleep(0)  # let the subscriber print any eviction event here
        first = out.keys_to_store[0]
        in_flight = self.manager.lookup(first, self.ctx)
        say(f"lookup({NAMES[first]}) while its copy runs", f"-> {in_flight} (ask again later)")
        await copy_finished()
        self.manager.complete_store(out.reservation)  # exactly the keys this store reserved
        say(f"complete_store({names(out.keys_to_store)})")
        await copy_finished()


async def tour(policy: str) -> int:
    """Walk the scenario under ``policy``; returns the hot-prefix hits after the scan."""
    config = OffloadConfig(
        gpu_block_sizes=(16,),
        hash_block_size=16,
        cpu_bytes_to_use=POOL_BLOCKS * BLOCK_BYTES,
        kv_bytes_per_block=BLOCK_BYTES,
        eviction_policy=policy,
    )
    print(f"\n=== {policy.upper()}: {config.num_cpu_blocks}-block CPU pool ===")
    hot = [block("hot0"), block("hot1")]
    async with CPUOffloadingSpec(config) as spec:
        manager = spec.get_manager()
        events = manager.subscribe(maxsize=64)
        printer = asyncio.create_task(print_events(events))
        scheduler = Scheduler(manager)

        await scheduler.request("req 1", hot)
        await scheduler.request("req 2, same prefix", [*hot, block("a2")])
        await scheduler.request("req 3, one-off scan", [block("scan0"), block("scan1")])
        await scheduler.request("req 4, one-off scan", [block("scan2"), block("scan3")])
        hits = await scheduler.request("req 5, prefix again", [*hot, block("b2")])

        print("[pinned] a load holds the prefix while a big store arrives")
        spec_ids = block_ids(manager.prepare_load(hot, scheduler.ctx))
        say(f"prepare_load({names(hot)})", f"pins CPU blocks {spec_ids}")
        await scheduler.store([block(f"big{i}") for i in range(3)])
        manager.complete_load(hot)
        await copy_finished()
    # Leaving the spec shut the manager down, which closed the subscription.
    await printer
    print(f"  subscriber done: dropped {events.dropped} events")
    return hits


async def main() -> int:
    hits = {policy: await tour(policy) for policy in ("lru", "arc")}
    print(
        "\nhot prefix blocks still offloaded after the scan: "
        + ", ".join(f"{policy.upper()} {n}/2" for policy, n in hits.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main()))
