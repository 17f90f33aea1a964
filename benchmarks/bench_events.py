"""What abandoned event subscriptions cost the manager, side by side in one run.

Three managers replay the same requests (``bench_manager.py``'s trace and
request loop, lookup_prefix mode, capacity 10k) in alternating chunks:

* ``none``: no subscription;
* ``abandoned``: ``--subs`` subscriptions, each read by ``async for`` until
  its first event and then dropped without ``close()``;
* ``held``: ``--subs`` subscriptions still referenced and never read (each
  buffers up to its ``maxsize`` and then drops), which is what an abandoned
  one cost before the manager held subscriptions weakly.

Prints µs per request and the ratio to ``none``; ``abandoned`` should be ~1.

    python benchmarks/bench_events.py [--subs 300] [--requests 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time

from bench_manager import Trace, replay  # the script's folder is on sys.path

from aiokvo.events import EventSubscription
from aiokvo.keys import make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.specs import ReqContext


async def abandon(manager: CPUOffloadingManager, count: int) -> None:
    """``count`` times: subscribe, read one event with ``async for``, return."""

    async def first_event(i: int) -> None:
        sub = manager.subscribe()
        out = manager.prepare_store([make_offload_key(b"probe%d" % i, 0)], ReqContext())
        assert out is not None
        manager.complete_store(out.keys_to_store)  # a "stored" event
        async for _ in sub:
            return

    for i in range(count):
        await first_event(i)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--subs", type=int, default=300)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--chunk", type=int, default=1_000)
    parser.add_argument("--capacity", type=int, default=10_000)
    args = parser.parse_args(argv)
    warm = 30_000
    trace = Trace.generate(args.capacity, warm + args.requests, seed=0)
    sequences, requests = trace.key_lists(), trace.requests.tolist()
    managers = {name: CPUOffloadingManager(args.capacity) for name in ("none", "abandoned", "held")}
    asyncio.run(abandon(managers["abandoned"], args.subs))
    held: list[EventSubscription] = [managers["held"].subscribe() for _ in range(args.subs)]
    gc.collect()
    for manager in managers.values():
        replay(manager, sequences, requests[:warm], True)
    us: dict[str, list[float]] = {name: [] for name in managers}
    names = list(managers)
    for n, start in enumerate(range(warm, warm + args.requests - args.chunk + 1, args.chunk)):
        window = requests[start : start + args.chunk]
        for name in names if n % 2 == 0 else names[::-1]:
            us[name].append(replay(managers[name], sequences, window, True,
                                   collect=False).us_per_req)
    base = statistics.median(us["none"])
    print(f"# bench_events  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
          f"{args.subs} subscriptions, {len(us['none'])} chunks of {args.chunk:,} requests, "
          f"alternating order")
    print("| manager | subscriptions attached | µs/req (median) | ratio to none |")
    print("|---|---:|---:|---:|")
    for name, manager in managers.items():
        median = statistics.median(us[name])
        attached = len(manager._sink._subscribers)
        print(f"| {name} | {attached} | {median:.2f} | {median / base:.2f} |")
    assert held  # kept referenced until here
    return 0


if __name__ == "__main__":
    sys.exit(main())
