"""Manager hot-path benchmark: aiokvo's CPUOffloadingManager vs vLLM's, same trace.

The trace (issue 3): sequences of 64 block keys (32-byte hash + group 0)
forming a prefix tree. Each new sequence copies the first 0..63 blocks of a
random earlier one and fills the rest with new blocks, until the universe
holds 4x the capacity. Requests pick a sequence with Zipf(1.0) popularity
over a shuffled rank order. Everything is seeded; ``--save``/``--load`` keep
it in an ``.npz`` so another implementation replays the very same requests.

Each request: look keys up in order until the first miss (measured both as
a ``lookup`` loop and as one ``lookup_prefix`` call), ``prepare_load`` and
``complete_load`` the hits, ``prepare_store`` the rest, ``touch`` all 64
keys, ``complete_store`` what was stored (by its reservation, the way aiokvo
is driven; vLLM completes by key list).

Reported: requests/s, µs/request, block hit rate, bytes per cached block
(tracemalloc while filling to capacity, key objects excluded), and the
µs/request ratio between capacity 1M and 10k. ``--peer`` runs vLLM 0.32 on
the same ``.npz`` with the peer's Python, side by side, and prints ratios.

The scale section compares steady states: each size replays its own trace
(universe 4x its capacity) from an empty manager until the pool is full and
the hit rate stops moving, then times a window whole and a second window
operation by operation, and prints hit rate, stored and evicted blocks per
request and µs per operation at both sizes, so one sees which one grows.
The whole window is at least 0.3 x capacity requests: a churned dict of 1M
keys is re-indexed every ~250k requests at these store rates (~0.1 s each),
so a shorter window either misses that cost or charges all of it to a few
requests; at 0.3 x capacity both sizes pay it at about its average rate.

``--paired A,B`` measures a small change on a noisy box: two managers
(policies by name or module path) replay the same steady-state requests in
lockstep chunks, alternating which goes first, and the per-chunk differences
give a mean and its standard error, so load drift cancels.

    python benchmarks/bench_manager.py                       # aiokvo only
    python benchmarks/bench_manager.py --peer .vllm-venv/bin/python
    python benchmarks/bench_manager.py --paired lru,mypkg.lru:LRU --paired-capacity 1000000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from aiokvo.keys import OffloadKey
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.specs import ReqContext

SEQ_LEN = 64
HASH_BYTES = 32
GROUP0 = b"\x00\x00\x00\x00"
PEER_SCRIPT = Path(__file__).with_name("_peer_replay.py")


# -- the trace -------------------------------------------------------------------


@dataclass
class Trace:
    """``sequences[i]`` are indices into ``hashes``; ``requests`` index sequences."""

    capacity: int
    hashes: npt.NDArray[np.uint8]  # (universe, 32)
    sequences: npt.NDArray[np.int32]  # (num_sequences, 64)
    requests: npt.NDArray[np.int32]  # (num_requests,)

    @classmethod
    def generate(cls, capacity: int, num_requests: int, seed: int) -> Trace:
        rng = np.random.default_rng(seed)
        universe = 4 * capacity
        rows: list[npt.NDArray[np.int32]] = []
        used = 0
        while used < universe:
            shared = int(rng.integers(0, SEQ_LEN)) if rows else 0
            shared = max(shared, SEQ_LEN - (universe - used))  # never overshoot
            row = np.empty(SEQ_LEN, dtype=np.int32)
            if shared:
                parent = rows[int(rng.integers(0, len(rows)))]
                row[:shared] = parent[:shared]
            fresh = SEQ_LEN - shared
            row[shared:] = np.arange(used, used + fresh, dtype=np.int32)
            used += fresh
            rows.append(row)
        sequences = np.stack(rows)
        ranks = np.arange(1, len(rows) + 1, dtype=np.float64)
        popularity = 1.0 / ranks  # Zipf(1.0)
        popularity /= popularity.sum()
        order = rng.permutation(len(rows)).astype(np.int32)  # rank -> sequence
        picks = rng.choice(len(rows), size=num_requests, p=popularity)
        hashes = rng.integers(0, 256, size=(universe, HASH_BYTES), dtype=np.uint8)
        return cls(capacity, hashes, sequences, order[picks])

    def save(self, path: str) -> None:
        np.savez(
            path, capacity=self.capacity, hashes=self.hashes,
            sequences=self.sequences, requests=self.requests,
        )

    @classmethod
    def load(cls, path: str) -> Trace:
        data = np.load(path)
        return cls(int(data["capacity"]), data["hashes"], data["sequences"], data["requests"])

    def key_lists(self) -> list[list[OffloadKey]]:
        """One list of key objects per sequence; shared prefixes share objects."""
        keys = [OffloadKey(bytes(row) + GROUP0) for row in self.hashes]
        return [[keys[i] for i in row] for row in self.sequences.tolist()]


# -- replay ----------------------------------------------------------------------


@dataclass
class Result:
    req_per_s: float
    us_per_req: float
    hit_rate: float


def replay(
    manager: CPUOffloadingManager, sequences: list[list[OffloadKey]], requests: list[int],
    prefix: bool, collect: bool = True,
) -> Result:
    ctx = ReqContext()
    lookup, lookup_prefix = manager.lookup, manager.lookup_prefix
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    touch = manager.touch
    hits_total = 0
    if collect:
        gc.collect()
    start = time.perf_counter()
    for seq_idx in requests:
        keys = sequences[seq_idx]
        if prefix:
            hits = lookup_prefix(keys, ctx) or 0
        else:
            hits = 0
            for key in keys:
                if lookup(key, ctx) is not True:
                    break
                hits += 1
        if hits:
            loaded = keys[:hits]
            prepare_load(loaded, ctx)
            complete_load(loaded)
        out = prepare_store(keys[hits:], ctx)
        touch(keys)
        if out is not None and out.keys_to_store:
            complete_store(out.reservation)
        hits_total += hits
    elapsed = time.perf_counter() - start
    return Result(
        len(requests) / elapsed, elapsed / len(requests) * 1e6,
        hits_total / (len(requests) * SEQ_LEN),
    )


def fill(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> None:
    ctx = ReqContext()
    for i in range(0, len(keys), SEQ_LEN):
        out = manager.prepare_store(keys[i : i + SEQ_LEN], ctx)
        assert out is not None
        manager.complete_store(out.reservation)


def bytes_per_block(capacity: int, policy: str) -> float:
    """tracemalloc growth per block while filling an empty manager to capacity."""
    keys = [OffloadKey(i.to_bytes(HASH_BYTES, "big") + GROUP0) for i in range(capacity)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    manager = CPUOffloadingManager(capacity, policy)
    fill(manager, keys)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(manager) == capacity
    return (after - before) / capacity


OPS = ("lookup_prefix", "prepare_load", "complete_load", "prepare_store", "touch",
       "complete_store")


@dataclass
class ScalePoint:
    """Steady-state cost at one capacity: the whole request and each operation."""

    capacity: int
    warm_requests: int
    warm_hit_rates: list[float]
    window: int  # requests timed whole
    us_per_req: float  # window timed as a whole (no per-call timers)
    gc_runs: list[int]  # automatic collections per generation in that window
    hit_rate: float
    op_us: dict[str, float]  # µs per request in each operation (second window)
    stored_per_req: float
    evicted_per_req: float


def replay_ops(
    manager: CPUOffloadingManager, sequences: list[list[OffloadKey]], requests: list[int],
) -> tuple[dict[str, float], float, float]:
    """The request loop of :func:`replay` with a timer around every call.

    Returns µs per request spent in each operation, and stored and evicted
    blocks per request. The timers add the same small cost at every size.
    """
    ctx = ReqContext()
    clock = time.perf_counter
    spent = dict.fromkeys(OPS, 0.0)
    stored = evicted = 0
    gc.collect()
    for seq_idx in requests:
        keys = sequences[seq_idx]
        t0 = clock()
        hits = manager.lookup_prefix(keys, ctx) or 0
        t1 = clock()
        spent["lookup_prefix"] += t1 - t0
        if hits:
            loaded = keys[:hits]
            t0 = clock()
            manager.prepare_load(loaded, ctx)
            t1 = clock()
            manager.complete_load(loaded)
            t2 = clock()
            spent["prepare_load"] += t1 - t0
            spent["complete_load"] += t2 - t1
        t0 = clock()
        out = manager.prepare_store(keys[hits:], ctx)
        t1 = clock()
        manager.touch(keys)
        t2 = clock()
        spent["prepare_store"] += t1 - t0
        spent["touch"] += t2 - t1
        if out is not None and out.keys_to_store:
            t0 = clock()
            manager.complete_store(out.reservation)
            spent["complete_store"] += clock() - t0
            stored += len(out.keys_to_store)
            evicted += len(out.evicted_keys)
    n = len(requests)
    return {op: t / n * 1e6 for op, t in spent.items()}, stored / n, evicted / n


def warm_up(
    manager: CPUOffloadingManager, sequences: list[list[OffloadKey]], requests: list[int],
    chunk: int, tolerance: float,
) -> tuple[int, list[float]]:
    """Replay ``requests`` in chunks until the pool is full and the hit rate settles.

    Returns how many requests were replayed and each chunk's hit rate.
    """
    rates: list[float] = []
    done = 0
    while done + chunk <= len(requests):
        rates.append(replay(manager, sequences, requests[done : done + chunk], True).hit_rate)
        done += chunk
        full = manager.num_free_blocks == 0
        if full and len(rates) >= 2 and abs(rates[-1] - rates[-2]) <= tolerance:
            break
    return done, rates


def whole_window(capacity: int, minimum: int) -> int:
    """Requests timed whole at one size: enough to include table resizes.

    Each churned table (a few stores and evictions per request) is
    re-indexed every ~0.25 x capacity requests, at O(capacity) cost; 0.3 x
    capacity requests contain about one, so the window pays its average
    share, as the 10k window (many resizes) does anyway.
    """
    return max(minimum, capacity * 3 // 10)


def scale_point(
    trace: Trace, sequences: list[list[OffloadKey]], policy: str, window: int,
    ops_window: int, chunk: int, tolerance: float,
) -> ScalePoint:
    """µs/request in steady state, warmed by the trace itself.

    The manager starts empty and replays the trace in chunks of ``chunk``
    requests (untimed) until it is full and the hit rate of a chunk is
    within ``tolerance`` of the chunk before it. The next ``window``
    requests are timed as a whole, the ``ops_window`` after those op by op.
    So both sizes are measured with the cache in the state their own
    trace drives it to, not after an arbitrary prefill. Automatic garbage
    collections during the whole window are counted (there should be none:
    the keys are ``bytes``, not tracked by the collector).
    """
    requests = trace.requests.tolist()
    manager = CPUOffloadingManager(trace.capacity, policy)
    done, rates = warm_up(manager, sequences, requests[: len(requests) - window - ops_window],
                          chunk, tolerance)
    gc.collect()
    runs_before = [g["collections"] for g in gc.get_stats()]
    timed = replay(manager, sequences, requests[done : done + window], True, collect=False)
    gc_runs = [g["collections"] - b for g, b in zip(gc.get_stats(), runs_before, strict=True)]
    op_us, stored, evicted = replay_ops(
        manager, sequences, requests[done + window : done + window + ops_window])
    return ScalePoint(trace.capacity, done, rates, window, timed.us_per_req, gc_runs,
                      timed.hit_rate, op_us, stored, evicted)


def probe_ns(capacity: int, probes: int = 1_000_000, seed: int = 0) -> float:
    """ns per ``key in OrderedDict`` on a table of ``capacity`` keys (control).

    The same C probe at two sizes: any growth is memory latency, the floor
    for every hash-table-based manager, not an algorithmic cost.
    """
    from collections import OrderedDict

    rng = np.random.default_rng(seed)
    keys = [bytes(row) + GROUP0 for row in rng.integers(0, 256, (capacity, HASH_BYTES),
                                                         dtype=np.uint8)]
    table = OrderedDict.fromkeys(keys, 0)
    picks = [keys[i] for i in rng.integers(0, capacity, probes).tolist()]
    contains = table.__contains__
    start = time.perf_counter()
    assert all(map(contains, picks))
    return (time.perf_counter() - start) / probes * 1e9


def paired_section(args: argparse.Namespace) -> None:
    """Two policies on the same steady-state requests, in alternating lockstep chunks."""
    names = args.paired.split(",")
    if len(names) != 2:
        raise SystemExit(f"--paired wants two policies A,B, got {args.paired!r}")
    capacity, chunk = args.paired_capacity, args.paired_chunk
    trace = Trace.generate(capacity, args.scale_warm_max + args.paired_requests, args.seed)
    sequences, requests = trace.key_lists(), trace.requests.tolist()
    first = CPUOffloadingManager(capacity, names[0])
    warm, _ = warm_up(first, sequences, requests[: args.scale_warm_max],
                      max(10_000, capacity // 20), args.scale_tolerance)
    second = CPUOffloadingManager(capacity, names[1])
    replay(second, sequences, requests[:warm], True)  # the same warm-up requests
    managers = (first, second)
    us: tuple[list[float], list[float]] = ([], [])
    gc.collect()
    for n, start in enumerate(range(warm, warm + args.paired_requests - chunk + 1, chunk)):
        window = requests[start : start + chunk]
        for side in (0, 1) if n % 2 == 0 else (1, 0):
            us[side].append(replay(managers[side], sequences, window, True,
                                   collect=False).us_per_req)
    diffs = [b - a for a, b in zip(*us, strict=True)]
    stderr = statistics.stdev(diffs) / len(diffs) ** 0.5
    print(f"Paired at capacity {capacity:,}: {warm:,} warm-up requests each, then "
          f"{len(diffs)} chunks of {chunk:,} requests, alternating which goes first.")
    for name, timings in zip(names, us, strict=True):
        print(f"  {name}: mean {statistics.mean(timings):.2f} µs/req, "
              f"median {statistics.median(timings):.2f}")
    print(f"  {names[1]} - {names[0]}: {statistics.mean(diffs):+.2f} ± {stderr:.2f} µs/req "
          f"(mean ± standard error; median {statistics.median(diffs):+.2f})")


# -- the peer --------------------------------------------------------------------


def run_peer(python: str, trace_path: str, policy: str, lifecycle: bool,
             memory: bool) -> dict[str, float]:
    """One replay of ``policy`` on vLLM, in the peer's own interpreter."""
    cmd = [python, str(PEER_SCRIPT), trace_path, "--policy", policy]
    if lifecycle:
        cmd.append("--lifecycle")
    if memory:
        cmd.append("--memory")
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (row,) = rows
    row.pop("policy")
    return dict(row)


# -- main ------------------------------------------------------------------------


def _best(old: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    if old is None or new["req_per_s"] > old["req_per_s"]:
        return {**(old or {}), **new}
    return old


def scale_section(args: argparse.Namespace, policies: list[str]) -> None:
    """The 10k vs 1M comparison, each size warmed to steady state by its own trace."""
    sizes = (args.capacity, args.scale_capacity)
    ops_window = args.scale_requests
    windows = {size: whole_window(size, ops_window) for size in sizes}
    print()
    print(f"Scale: steady state, capacity {sizes[0]:,} vs {sizes[1]:,} (universe 4x, "
          f"its own trace each); warmed by replaying the trace in chunks of "
          f"max(10k, capacity/20) requests until full and the chunk hit rate moves "
          f"<= {args.scale_tolerance}; then max({ops_window:,}, 0.3 x capacity) requests "
          f"timed whole and {ops_window:,} more op by op; best of {args.repeat} "
          f"interleaved rounds.")
    traces: dict[int, tuple[Trace, list[list[OffloadKey]]]] = {}
    for size in sizes:
        t0 = time.perf_counter()
        trace = Trace.generate(size, args.scale_warm_max + windows[size] + ops_window,
                               args.seed)
        traces[size] = (trace, trace.key_lists())
        print(f"# scale trace {size:,}: built in {time.perf_counter() - t0:.1f}s")
    for policy in policies:
        best: dict[int, ScalePoint] = {}
        for _ in range(args.repeat):
            for size in sizes:
                trace, seqs = traces[size]
                chunk = max(10_000, size // 20)
                p = scale_point(trace, seqs, policy, windows[size], ops_window, chunk,
                                args.scale_tolerance)
                if size not in best or p.us_per_req < best[size].us_per_req:
                    best[size] = p
        lo, hi = best[sizes[0]], best[sizes[1]]
        print(f"\n  {policy}: {lo.us_per_req:.2f} µs/req -> {hi.us_per_req:.2f} µs/req: "
              f"ratio {hi.us_per_req / lo.us_per_req:.2f}")
        print("  | | " + " | ".join(f"{s:,}" for s in sizes) + " | ratio |")
        print("  |---|---:|---:|---:|")
        for label, a, b in (
            ("warm-up requests", lo.warm_requests, hi.warm_requests),
            ("requests timed whole", lo.window, hi.window),
            ("hit rate (timed window)", lo.hit_rate, hi.hit_rate),
            ("stored blocks / req", lo.stored_per_req, hi.stored_per_req),
            ("evicted blocks / req", lo.evicted_per_req, hi.evicted_per_req),
        ):
            print(f"  | {label} | {a:,.3f} | {b:,.3f} | {b / a if a else 0:.2f} |")
        for op in OPS:
            a, b = lo.op_us[op], hi.op_us[op]
            print(f"  | µs/req in {op} | {a:.2f} | {b:.2f} | {b / a if a else 0:.2f} |")
        a, b = sum(lo.op_us.values()), sum(hi.op_us.values())
        print(f"  | µs/req, sum of ops (timers on) | {a:.2f} | {b:.2f} | {b / a:.2f} |")
        for p in (lo, hi):
            print(f"  # automatic gc runs (gen 0/1/2) in the whole window at {p.capacity:,}: "
                  + "/".join(map(str, p.gc_runs)))
            print(f"  # warm-up chunk hit rates at {p.capacity:,}: "
                  + " ".join(f"{r:.3f}" for r in p.warm_hit_rates))
    del traces
    small_ns = min(probe_ns(sizes[0]) for _ in range(args.repeat))
    large_ns = min(probe_ns(sizes[1]) for _ in range(args.repeat))
    print(f"\n  control, one OrderedDict membership probe (random keys): "
          f"{small_ns:.0f} ns -> {large_ns:.0f} ns: ratio {large_ns / small_ns:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--capacity", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--save", help="write the trace to this .npz")
    parser.add_argument("--load", help="replay this .npz instead of generating")
    parser.add_argument("--peer", metavar="PYTHON",
                        help="also replay on vLLM with this interpreter (.vllm-venv/bin/python)")
    parser.add_argument("--peer-lifecycle", action="store_true",
                        help="also time vLLM with on_new_request/on_request_finished per request")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds; each round runs every configuration once, "
                        "interleaved, and the best round per configuration is kept")
    parser.add_argument("--scale-capacity", type=int, default=1_000_000)
    parser.add_argument("--scale-requests", type=int, default=20_000,
                        help="requests in the op-by-op scale window, and the least in the "
                        "window timed whole (which is at least 0.3 x capacity)")
    parser.add_argument("--scale-warm-max", type=int, default=400_000,
                        help="most warm-up requests per scale point")
    parser.add_argument("--scale-tolerance", type=float, default=0.005,
                        help="warm-up ends when a chunk's hit rate moves by at most this")
    parser.add_argument("--no-scale", action="store_true")
    parser.add_argument("--paired", metavar="A,B",
                        help="only a paired A/B of two policies (see the module docstring)")
    parser.add_argument("--paired-capacity", type=int, default=10_000)
    parser.add_argument("--paired-requests", type=int, default=100_000,
                        help="requests replayed by both after the warm-up")
    parser.add_argument("--paired-chunk", type=int, default=2_000)
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")

    print(f"# bench_manager  python {platform.python_version()}  nproc {os.cpu_count()}  "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.paired:
        paired_section(args)
        return 0
    t0 = time.perf_counter()
    trace = Trace.load(args.load) if args.load else Trace.generate(
        args.capacity, args.requests, args.seed)
    if args.save:
        trace.save(args.save)
    sequences = trace.key_lists()
    requests = trace.requests.tolist()
    print(f"# trace: capacity {trace.capacity}, universe {len(trace.hashes)} blocks, "
          f"{len(trace.sequences)} sequences, {len(requests)} requests "
          f"(built in {time.perf_counter() - t0:.1f}s)")

    tmp = tempfile.TemporaryDirectory()
    trace_path = args.save or args.load or os.path.join(tmp.name, "trace.npz")
    if args.peer and not (args.save or args.load):
        trace.save(trace_path)
    peer_variants = ["bare", "lifecycle"] if args.peer_lifecycle else ["bare"]
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    for round_no in range(args.repeat):
        for policy in policies:
            for mode in ("loop", "prefix"):
                manager = CPUOffloadingManager(trace.capacity, policy)
                r = replay(manager, sequences, requests, prefix=(mode == "prefix"))
                del manager
                key = ("aiokvo", policy, mode)
                rows[key] = _best(rows.get(key), vars(r))
            if args.peer:
                for variant in peer_variants:
                    p = run_peer(args.peer, trace_path, policy, variant == "lifecycle",
                                 memory=(round_no == 0 and variant == "bare"
                                         and not args.no_memory))
                    key = (f"vLLM 0.32 ({variant})", policy, "loop")
                    rows[key] = _best(rows.get(key), p)
            if round_no == 0 and not args.no_memory:
                for mode in ("loop", "prefix"):
                    rows[("aiokvo", policy, mode)]["bytes_per_block"] = bytes_per_block(
                        trace.capacity, policy)
    tmp.cleanup()

    print()
    print("| impl | policy | lookups | req/s | µs/req | hit rate | bytes/block |")
    print("|---|---|---|---:|---:|---:|---:|")
    for (impl, policy, mode), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        mem = f"{row['bytes_per_block']:.1f}" if "bytes_per_block" in row else "-"
        print(f"| {impl} | {policy} | {mode} | {row['req_per_s']:,.0f} | "
              f"{row['us_per_req']:.2f} | {row['hit_rate']:.4f} | {mem} |")
    if args.peer:
        print()
        print("Speed-up (aiokvo req/s / vLLM req/s, same trace, interleaved rounds):")
        for policy in policies:
            for variant in peer_variants:
                base = rows[(f"vLLM 0.32 ({variant})", policy, "loop")]
                for mode in ("loop", "prefix"):
                    ours = rows[("aiokvo", policy, mode)]
                    print(f"  {policy} {mode:6s} vs vLLM {variant:9s}: "
                          f"{ours['req_per_s'] / base['req_per_s']:6.2f}x   hit rate "
                          f"{ours['hit_rate']:.4f} vs {base['hit_rate']:.4f}")

    if not args.no_scale:
        scale_section(args, policies)
    print(f"\n# total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
