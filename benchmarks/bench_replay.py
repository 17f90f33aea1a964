"""Policy lab benchmark: replay speed and bytes per cached block, for every policy.

1. **Replay speed.** ``aiokvo replay``'s driver (lookup_prefix, prepare_load,
   complete_load, prepare_store, touch, complete_store per request) replays
   the trace through a fresh ``CPUOffloadingManager`` per policy and pool
   size. Each round runs every policy once, in an order rotated from round
   to round, so load drift on a shared machine spreads over all of them;
   the table gives median block references per second (wall clock and per
   CPU second of this process) and the median per-round ratio to LRU. The
   target (issue 20) is 200k references/s: the whole 288,500-reference
   Mooncake trace in under 1.5 s per policy and size.
2. **Bytes per cached block**, measured as ``bench_manager.py`` measures it
   (tracemalloc growth while filling an empty manager to capacity, key
   objects excluded; target at most 128), and in steady state: the growth
   from before the manager is made to the end of a replay of the trace at
   that size (key objects again excluded: the trace made them first), so
   it includes ghost lists, filters and every other history a policy keeps.
3. **A second workload** (``--only zipf``): hit rates on bench_manager.py's trace
   (prefix trees with stationary Zipf popularity), beside Belady's, so a policy
   tuned to one trace shows where it loses on another.

    python benchmarks/bench_replay.py TRACE.jsonl                 # every section
    python benchmarks/bench_replay.py TRACE.jsonl --rounds 5 --capacity 0.01 0.1
    python benchmarks/bench_replay.py --only zipf                  # the second workload only
    python benchmarks/bench_replay.py --quick                      # a synthetic trace, smoke
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_manager import Trace as ZipfTrace
from bench_manager import bytes_per_block

from aiokvo.lab.belady import belady_hits
from aiokvo.lab.replay import capacity_blocks, replay
from aiokvo.lab.trace import Trace, parse_trace, read_trace
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies import BUILTIN_POLICIES
from aiokvo.specs import ReqContext


def synthetic(requests: int, seed: int = 0) -> Trace:
    """Conversation-shaped requests (a turn extends an earlier one), for --quick."""
    rng = random.Random(seed)
    rows: list[list[int]] = []
    next_id = 0
    for _ in range(requests):
        prefix = rows[rng.randrange(len(rows))][:] if rows and rng.random() < 0.6 else [0]
        fresh = list(range(next_id + 1, next_id + 1 + rng.randint(1, 20)))
        next_id += len(fresh)
        rows.append(prefix + fresh)
    return parse_trace(f'{{"timestamp": {i}, "hash_ids": {r}}}' for i, r in enumerate(rows))


def speed(trace: Trace, policies: list[str], fractions: list[float], rounds: int) -> None:
    print("## 1. Replay speed (block references per second)\n")
    print(f"{len(trace)} requests, {trace.references} references, "
          f"{trace.distinct_blocks} distinct blocks; {rounds} rounds, order rotated\n")  # fmt: skip
    print("| policy | capacity | blocks | hit rate | refs/s (wall) | refs/CPU-s | vs LRU |")
    print("|---|---|---|---|---|---|---|")
    for fraction in fractions:
        blocks = capacity_blocks(fraction, trace.distinct_blocks)
        wall: dict[str, list[float]] = {p: [] for p in policies}
        cpu: dict[str, list[float]] = {p: [] for p in policies}
        hit: dict[str, float] = {}
        for r in range(rounds):
            order = policies[r % len(policies):] + policies[: r % len(policies)]
            for policy in order:
                gc.collect()
                result = replay(trace.keys, policy, blocks)
                wall[policy].append(result.references / result.seconds)
                cpu[policy].append(result.references / max(result.cpu_seconds, 1e-9))
                hit[policy] = result.hit_rate
        for policy in policies:
            ratio = statistics.median(
                w / b for w, b in zip(wall[policy], wall["lru"], strict=True)
            ) if "lru" in wall else float("nan")  # fmt: skip
            print(f"| {policy} | {fraction:g} | {blocks} | {100 * hit[policy]:.2f}% | "
                  f"{statistics.median(wall[policy]) / 1e3:.0f}k | "
                  f"{statistics.median(cpu[policy]) / 1e3:.0f}k | {ratio:.2f}x |")  # fmt: skip
    print()


def steady_bytes_per_block(trace: Trace, policy: str, blocks: int) -> float:
    """tracemalloc growth over making the manager and replaying the whole trace."""
    ctx = ReqContext()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    manager = CPUOffloadingManager(blocks, policy)
    for keys in trace.keys:
        found = manager.lookup_prefix(keys, ctx)
        if found:
            manager.prepare_load(keys[:found], ctx)
            manager.complete_load(keys[:found])
        out = manager.prepare_store(keys, ctx)
        manager.touch(keys)
        if out is not None:
            manager.complete_store(out.reservation)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / len(manager)


def memory(
    trace: Trace, policies: list[str], fractions: list[float], fills: list[int], steady: bool
) -> None:
    print("## 2. Bytes per cached block\n")
    print("fill N: bench_manager.py's measurement with N blocks (its default is 10,000; "
          "target <= 128); steady F: after replaying the trace with a pool of F of its "
          "distinct blocks (ghosts and filters included)\n")  # fmt: skip
    heads = [f"fill {n}" for n in fills] + ([f"steady {f:g}" for f in fractions] if steady else [])
    print("| policy | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for policy in policies:
        cells = [f"{bytes_per_block(n, policy):.1f}" for n in fills]
        if steady:
            sizes = [capacity_blocks(f, trace.distinct_blocks) for f in fractions]
            cells += [f"{steady_bytes_per_block(trace, policy, n):.0f}" for n in sizes]
        print(f"| {policy} | " + " | ".join(cells) + " |")
    print()


def zipf_section(policies: list[str], requests: int) -> None:
    """Hit rates on a second workload: bench_manager.py's trace (stationary popularity)."""
    print("## 3. A second workload: bench_manager.py's Zipf prefix trees\n")
    print(f"64-key sequences sharing prefixes, universe 8,000 blocks, Zipf(1.0) popularity, "
          f"{requests} requests, seed 0 (bench_manager.Trace.generate(2000, ...))\n")  # fmt: skip
    trace = ZipfTrace.generate(2000, requests, 0)
    sequences = trace.key_lists()
    keyed = [sequences[i] for i in trace.requests.tolist()]
    ids = [[hash(key) for key in request] for request in keyed]
    sizes = (500, 1000, 2000, 4000)
    print("| policy | " + " | ".join(f"{n} blocks" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for policy in policies:
        rates = [replay(keyed, policy, n).hit_rate for n in sizes]
        print(f"| {policy} | " + " | ".join(f"{100 * r:.1f}%" for r in rates) + " |")
    bounds = [belady_hits(ids, n).hit_rate for n in sizes]
    print("| Belady | " + " | ".join(f"{100 * r:.1f}%" for r in bounds) + " |\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", help="a JSONL trace (Mooncake format)")
    parser.add_argument("--policy", nargs="+", default=list(BUILTIN_POLICIES))
    parser.add_argument("--capacity", nargs="+", type=float, default=[0.01, 0.02, 0.05, 0.1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fill", type=int, nargs="+", default=[10_000],
                        help="pool sizes for the fill measurement (bench_manager's)")
    parser.add_argument("--steady", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure after replaying the trace")
    parser.add_argument("--quick", action="store_true",
                        help="a small synthetic trace, one round, small fill (a smoke test)")
    parser.add_argument("--only", choices=["speed", "memory", "zipf"])
    parser.add_argument("--zipf-requests", type=int, default=20_000)
    args = parser.parse_args(argv)
    if args.quick:
        trace, args.rounds, args.fill = synthetic(400), 1, [2000]
    elif args.trace:
        trace = read_trace(args.trace)
    elif args.only != "zipf":
        parser.error("give a trace file, or --quick")
    policies = ["lru", *[p for p in args.policy if p != "lru"]]
    print(f"# bench_replay ({time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, "
          f"{platform.machine()}, {args.trace or 'synthetic'})\n")  # fmt: skip
    if args.only in (None, "speed"):
        speed(trace, policies, args.capacity, args.rounds)
    if args.only in (None, "memory"):
        memory(trace, policies, args.capacity, args.fill, args.steady)
    if args.only in (None, "zipf"):
        zipf_section(policies, 1000 if args.quick else args.zipf_requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
