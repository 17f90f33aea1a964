"""Agentic replay: what the cache-control hints buy conversations that pause for tool calls.

Run:  .venv/bin/python benchmarks/bench_agentic.py [--rounds 5] [--requests 300] [--stall 10]
                                                   [--trace PATH] [--dir DIR] [--quick]

**Workload.** The Mooncake FAST'25 conversation trace (``shared/traces/``:
``hash_ids`` are 512-token prefix blocks; an id names its whole prefix).
Requests are grouped into conversations by their first block after the
system prompt's (``hash_ids[1]``: every request of one conversation starts
with the same blocks); conversations with at least ``--min-turns`` turns
and no request over ``--max-blocks`` blocks are taken in order of first
arrival, at most ``--max-turns`` turns each, until ``--requests`` requests.
Every id is one key (``make_offload_key`` of a hash of the id). The
trace's hour is compressed: conversation ``i`` starts at ``i / C`` of
``--stagger`` seconds, and between two turns the conversation pauses for a
tool call (lognormal, median ``--pause``, clipped to ``[--pause / 4,
--pause * 4]``), drawn from ``--seed`` per (conversation, turn), so every
mode and round replays the same requests with the same pauses.

**Engine.** A request arrives, takes GPU blocks (host tensors here: there
is no GPU, the worker copies host to host), waits in the engine's queue for
a scheduling delay (uniform in ``--sched-ms``, drawn per request), then calls
``load_prefix`` on all its blocks. The measured wait is that call, from the
moment the request is scheduled until its prefix is in its GPU blocks (the
time to first loaded block: one call loads the whole prefix); the hit rate
is blocks loaded (from the pool or the disk) / blocks asked, the CPU-pool
hit rate the part of them ready in the pool when the request was scheduled.
Then "prefill" (0.2 ms per block not loaded), ``store`` of every block,
"decode" (0.05 ms per output token, at most 40 ms), and the turn ends.

**Cache.** Blocks of ``--block-kib`` KiB (two tensors, K and V), a CPU pool
of ``--pool`` blocks (far smaller than the paused conversations' blocks), a
real disk tier below it in a fresh temporary directory per run (write-
through of every store, O_DIRECT where the filesystem takes it). Each mode
and round gets a fresh Offloader and tier directory.

**Modes**, in one run, the order rotated every round:

* ``none``: no hints; a load whose prefix left the pool reads it from disk;
* ``prefetch``: ``prefetch(keys, deadline=...)`` started as a task when the
  request arrives, so the read overlaps the queueing delay;
* ``demote+prefetch``: when a turn ends (the tool call starts) the
  conversation's own blocks are demoted (``demote``: committed on disk, CPU
  blocks freed); when the next turn arrives, prefetch as above;
* ``retain``: the conversation's own blocks are retained during the pause
  (``retain(ttl=--ttl)``), released when the next turn arrives.

"Own blocks" leave out the system prompt's block, which every conversation
shares (an orchestrator knows its own system prompt; demoting it would push
everyone's first block to disk).

Printed per mode: p50 and p99 wait (median over rounds) and the paired
ratio none/mode of each (median of the per-round ratios), both hit rates,
how many loaded blocks the load itself had to read from disk, and how many
prefetches were done when their request was scheduled.

**Stall** (``--stall S``, 0 to skip): with prefetch on arrival, one request
(the last turn of the conversation, among the first third, with the most own
blocks) has its disk reads stall for ``S`` seconds once: a ``FileIO`` (the
disk tier's ``file_io`` seam) sleeps in the first ``preadv`` that touches
that request's slots, armed right before its prefetch. That conversation is
demoted before its last turn in both variants, so the turn reads from disk;
the tier's ``io_timeout`` is ``S + 30`` in both, so it is a stall, not a
timeout. Runs with and without the stall alternate; the figure is the other
conversations' p99 wait with / without (median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import aiokvo
from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, make_offload_key
from aiokvo.keys import OffloadKey
from aiokvo.tiers import DiskTier, FileIO
from aiokvo.tiers.engine import StoreTier
from aiokvo.tiers.slot_index import SlotIndex

ROOT = Path(__file__).resolve().parents[1]
TRACE_NAME = "mooncake_conversation_trace.jsonl"
MODES = ("none", "prefetch", "demote+prefetch", "retain")
TENSORS = 2  # K and V


# ------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Turn:
    keys: list[OffloadKey]
    own: list[OffloadKey]  # the conversation's own blocks (not shared with another)
    output_tokens: int
    sched: float  # seconds in the engine's queue
    pause: float  # seconds of tool call after this turn (0 after the last)


@dataclass(frozen=True)
class Workload:
    conversations: list[list[Turn]]
    starts: list[float]
    distinct_blocks: int

    @property
    def requests(self) -> int:
        return sum(map(len, self.conversations))


def find_trace(given: str | None) -> Path:
    if given is not None:
        return Path(given)
    for base in (ROOT, ROOT.parent, ROOT.parent.parent):
        path = base / "shared" / "traces" / TRACE_NAME
        if path.is_file():
            return path
    raise SystemExit(f"{TRACE_NAME} not found next to the checkout; pass --trace PATH")


def read_requests(path: Path) -> list[tuple[list[int], int]]:
    """``(hash_ids, output_length)`` of every request, in timestamp order (ties: file order)."""
    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines):
            if line.strip():
                record = json.loads(line)
                rows.append(
                    (
                        float(record["timestamp"]),
                        number,
                        [int(h) for h in record["hash_ids"]],
                        int(record["output_length"]),
                    )
                )
    rows.sort(key=lambda row: (row[0], row[1]))
    return [(ids, output) for _, _, ids, output in rows]


def block_key(hash_id: int) -> OffloadKey:
    return make_offload_key(hashlib.blake2b(b"mooncake-%d" % hash_id, digest_size=16).digest(), 0)


def build_workload(args: argparse.Namespace) -> Workload:
    requests = read_requests(find_trace(args.trace))
    by_conv: dict[int, list[int]] = {}
    for i, (ids, _) in enumerate(requests):
        if len(ids) > 1:
            by_conv.setdefault(ids[1], []).append(i)
    chosen: list[list[int]] = []
    total = 0
    for members in sorted(by_conv.values(), key=lambda m: m[0]):  # by first arrival
        if len(members) < args.min_turns:
            continue
        if max(len(requests[i][0]) for i in members) > args.max_blocks:
            continue
        members = members[: args.max_turns]
        chosen.append(members)
        total += len(members)
        if total >= args.requests:
            break
    owners: dict[int, set[int]] = {}
    for c, members in enumerate(chosen):
        for i in members:
            for h in requests[i][0]:
                owners.setdefault(h, set()).add(c)
    lo, hi = args.sched_ms
    conversations = []
    for c, members in enumerate(chosen):
        turns = []
        for t, i in enumerate(members):
            rng = random.Random(f"{args.seed}-{c}-{t}")
            ids, output = requests[i]
            pause = 0.0
            if t < len(members) - 1:
                pause = min(max(rng.lognormvariate(math.log(args.pause), 0.6), args.pause / 4),
                            args.pause * 4)  # fmt: skip
            turns.append(Turn(
                keys=[block_key(h) for h in ids],
                own=[block_key(h) for h in ids if len(owners[h]) == 1],
                output_tokens=output,
                sched=rng.uniform(lo, hi) / 1000,
                pause=pause,
            ))  # fmt: skip
        conversations.append(turns)
    n = len(conversations)
    starts = [args.stagger * c / max(n, 1) for c in range(n)]
    return Workload(conversations, starts, len(owners))


# ---------------------------------------------------------------------- engine
class GpuBlocks:
    """The engine's GPU blocks: a request takes its own for as long as it runs."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n))
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    async def give(self, ids: list[int]) -> None:
        async with self._changed:
            self._free.extend(ids)
            self._changed.notify_all()


class StallingIO(FileIO):
    """The disk tier's system calls, but the first ``preadv`` touching an armed byte
    range of the data file sleeps ``seconds`` first (once; on the tier's I/O thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []
        self._seconds = 0.0
        self.stalls = 0

    def arm(self, ranges: list[tuple[int, int]], seconds: float) -> None:
        with self._lock:
            self._ranges, self._seconds = ranges, seconds

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        end = offset + sum(memoryview(b).nbytes for b in buffers)
        with self._lock:
            hit = any(lo < end and offset < hi for lo, hi in self._ranges)
            if hit:
                self._ranges = []
                self.stalls += 1
        if hit:
            time.sleep(self._seconds)
        return super().preadv(fd, buffers, offset)


@dataclass(frozen=True)
class Request:
    """One request as the scheduler saw it (for the profile of the slowest)."""

    conversation: int
    turn: int
    wait: float
    asked: int
    loaded: int
    ready: int  # leading blocks ready in the pool when it was scheduled
    prefetched: int  # what its prefetch returned; -1: none; -2: still running when scheduled

    def why(self) -> str:
        """Where its prefix was when the request was scheduled."""
        if self.ready >= self.loaded:
            return "in the pool"
        if self.prefetched == -2:
            return "prefetch still reading"
        if self.prefetched > self.ready:
            return "prefetched, then evicted"
        return "on disk, not prefetched"


@dataclass
class Run:
    """One replay's outcome: per request (conversation, turn) its wait and hits."""

    mode: str
    waits: dict[tuple[int, int], float] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    loaded: int = 0
    asked: int = 0
    prefetch_done: int = 0  # prefetches finished when their request was scheduled
    prefetches: int = 0
    disk_loaded: int = 0  # loaded blocks not ready in the pool when the load was called
    stalls: int = 0
    seconds: float = 0.0
    stats: Any = None

    def quantile(self, q: float, skip: int | None = None) -> float:
        values = sorted(w for (c, _), w in self.waits.items() if c != skip)
        return _quantile(values, q)


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (p99 of 300 values: the 297th)."""
    if not values:
        return math.nan
    rank = max(1, math.ceil(q * len(values)))
    return values[rank - 1]


def kv_caches(gpu_blocks: int, block_bytes: int) -> CanonicalKVCaches:
    page = block_bytes // TENSORS
    return CanonicalKVCaches.from_engine(
        [torch.zeros(gpu_blocks, page, dtype=torch.int8) for _ in range(TENSORS)]
    )


def in_pool(off: Offloader, keys: Sequence[OffloadKey]) -> int:
    """Leading keys ready in the CPU pool now."""
    for i, key in enumerate(keys):
        found = off.manager.block_status(key)
        if found is None or not found.is_ready:
            return i
    return len(keys)


async def replay(
    mode: str,
    work: Workload,
    kv: CanonicalKVCaches,
    args: argparse.Namespace,
    root: Path,
    *,
    stall: float = 0.0,
    victim: int | None = None,
) -> Run:
    block_bytes = kv.page_bytes_per_block
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=block_bytes,
        cpu_bytes_to_use=args.pool * block_bytes,
    )  # fmt: skip
    slot = -(-block_bytes // 4096) * 4096
    io = StallingIO()
    tier = DiskTier(
        root, capacity_bytes=(work.distinct_blocks + 256) * slot * 5 // 4 + (4 << 20),
        model_id="bench-agentic", refresh_interval=0, file_io=io,
        io_timeout=(stall + 30.0) if victim is not None else 10.0,
    )  # fmt: skip
    gpu = GpuBlocks(kv.num_blocks)
    out = Run(mode)
    hinted = mode in ("prefetch", "demote+prefetch")
    background: set[asyncio.Task[Any]] = set()

    def later(coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    async def conversation(c: int, turns: list[Turn]) -> None:
        await asyncio.sleep(work.starts[c])
        retained = None
        for t, turn in enumerate(turns):
            keys = turn.keys
            if retained is not None:
                retained.release()
                retained = None
            prefetch = None
            if hinted:
                if c == victim and t == len(turns) - 1 and stall:
                    io.arm(_slots_of(tier, turn.own), stall)
                prefetch = asyncio.ensure_future(off.prefetch(keys, deadline=args.deadline))
            ids = await gpu.take(len(keys))
            await asyncio.sleep(turn.sched)  # the engine is busy with other requests
            promoted = -1  # no prefetch; -2: still in flight when scheduled
            if prefetch is not None:
                out.prefetches += 1
                out.prefetch_done += prefetch.done()
                promoted = prefetch.result() if prefetch.done() else -2
            held = in_pool(off, keys)
            start = time.perf_counter()
            n = await off.load_prefix(keys, ids)
            wait = out.waits[c, t] = time.perf_counter() - start
            out.requests.append(Request(c, t, wait, len(keys), n, held, promoted))
            out.loaded += n
            out.asked += len(keys)
            out.disk_loaded += max(0, n - held)
            await asyncio.sleep(0.0002 * (len(keys) - n))  # prefill of what was not loaded
            await off.store(keys, ids)
            await asyncio.sleep(min(0.04, 0.00005 * turn.output_tokens))  # decode
            await gpu.give(ids)
            if prefetch is not None:
                await prefetch
            if turn.pause == 0:
                break
            if mode == "demote+prefetch" or (c == victim and t == len(turns) - 2):
                if c == victim:
                    await off.demote(turn.own)  # its last turn must read from disk
                else:
                    later(off.demote(turn.own))
            elif mode == "retain":
                retained = off.retain(turn.own, ttl=args.ttl)
            await asyncio.sleep(turn.pause)  # the tool call
        if retained is not None:
            retained.release()

    async with Offloader(config, kv, tiers=[tier]) as off:
        begin = time.perf_counter()
        await asyncio.gather(*(conversation(c, turns) for c, turns in
                               enumerate(work.conversations)))  # fmt: skip
        if background:
            await asyncio.gather(*background)
        out.seconds = time.perf_counter() - begin
        out.stats = off.statistics()
    out.stalls = io.stalls
    return out


def _slots_of(tier: StoreTier, keys: Sequence[OffloadKey]) -> list[tuple[int, int]]:
    """The data-file byte ranges of ``keys`` held by ``tier`` (one slab: our own)."""
    index = tier.index
    assert isinstance(index, SlotIndex)
    size = tier.statistics().slot_bytes  # type: ignore[attr-defined]
    ranges = []
    for key in keys:
        where = index.location(key)
        if where is not None:
            ranges.append((where.slot * size, (where.slot + 1) * size))
    return ranges


def pick_victim(work: Workload) -> int:
    """The conversation whose last turn is stalled: among the first third, the one with
    the most own blocks in that turn (at least two turns)."""
    third = max(1, len(work.conversations) // 3)
    candidates = [c for c in range(third) if len(work.conversations[c]) >= 2]
    if not candidates:
        candidates = [c for c, turns in enumerate(work.conversations) if len(turns) >= 2]
    return max(candidates, key=lambda c: (len(work.conversations[c][-1].own), -c))


# ----------------------------------------------------------------------- report
def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def slowest(run: Run, skip: int | None = None) -> str:
    """Where the prefixes of the slowest 1% (at least 3) were when they were scheduled."""
    mine = sorted((r for r in run.requests if r.conversation != skip), key=lambda r: -r.wait)
    top = mine[: max(3, len(mine) // 100)]
    counts: dict[str, int] = {}
    for r in top:
        counts[r.why()] = counts.get(r.why(), 0) + 1
    return ", ".join(f"{n} {why}" for why, n in counts.items())


def describe(run: Run) -> str:
    s = run.stats
    c = s.control
    disk = s.hits_by_medium.get("DISK", 0)
    return (f"{run.seconds:.1f}s, hit {run.loaded / max(run.asked, 1):.1%}, "
            f"not in pool when scheduled {run.disk_loaded}, tier reads {s.tiers[0].blocks_read}, "
        f"DISK hits of loads {disk}, "
            f"prefetches done when scheduled {run.prefetch_done}/{run.prefetches}, "
            f"late {c.prefetches_late}, wasted {c.prefetch_wasted_blocks}, "
            f"demoted {c.demoted_blocks}, refused stores {s.stores_refused}; "
            f"slowest: {slowest(run)}")  # fmt: skip


async def compare_modes(
    work: Workload, kv: CanonicalKVCaches, args: argparse.Namespace, tmp: Path
) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for mode in order:
            root = tmp / f"{mode.replace('+', '-')}-{r}"
            root.mkdir(mode=0o700)
            run = await replay(mode, work, kv, args, root)
            shutil.rmtree(root)
            runs[mode].append(run)
            print(
                f"round {r + 1} {mode:16} p50 {ms(run.quantile(0.5))} ms  "
                f"p99 {ms(run.quantile(0.99))} ms  ({describe(run)})",
                flush=True,
            )
    return runs


def print_modes(runs: dict[str, list[Run]], rounds: int) -> bool:
    base = runs["none"]
    print(
        "\n| mode | p50 wait ms | p99 wait ms | p50 none/mode | p99 none/mode | hit rate "
        "| CPU-pool hit rate when scheduled | not in pool when scheduled | tier blocks read "
        "| prefetch done when scheduled |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    met = False
    for mode in MODES:
        mine = runs[mode]
        p50 = statistics.median(x.quantile(0.5) for x in mine)
        p99 = statistics.median(x.quantile(0.99) for x in mine)
        r50 = statistics.median(
            b.quantile(0.5) / x.quantile(0.5) for b, x in zip(base, mine, strict=True)
        )
        r99 = statistics.median(
            b.quantile(0.99) / x.quantile(0.99) for b, x in zip(base, mine, strict=True)
        )
        hit = statistics.median(x.loaded / max(x.asked, 1) for x in mine)
        pool = statistics.median((x.loaded - x.disk_loaded) / max(x.asked, 1) for x in mine)
        disk = statistics.median(x.disk_loaded for x in mine)
        read = statistics.median(x.stats.tiers[0].blocks_read for x in mine)
        done = (f"{statistics.median(x.prefetch_done / x.prefetches for x in mine):.0%}"
                if mine[0].prefetches else "-")  # fmt: skip
        print(
            f"| {mode} | {ms(p50)} | {ms(p99)} | {r50:.2f}x | {r99:.2f}x | {hit:.1%} "
            f"| {pool:.1%} | {disk:g} | {read:g} | {done} |"
        )
        if mode == "prefetch":
            met = r99 >= 2.0
    disk_hits = statistics.median(x.stats.hits_by_medium.get("DISK", 0) for x in base)
    loaded = statistics.median(x.loaded for x in base)
    print(
        f"\n(medians over {rounds} rounds; ratios are medians of the per-round ratios; "
        f"no hints: the disk tier served {disk_hits:g} of {loaded:g} loaded blocks)"
    )
    print(
        f"target: prefetch on arrival cuts p99 wait >= 2x vs no hints: "
        f"{'met' if met else 'NOT met'}"
    )
    return met


async def compare_stall(
    work: Workload, kv: CanonicalKVCaches, args: argparse.Namespace, tmp: Path
) -> None:
    victim = pick_victim(work)
    last = work.conversations[victim][-1]
    print(f"\n## One request's reads stall for {args.stall:g} s (prefetch on arrival)\n")
    print(f"stalled: the last turn of conversation {victim} ({len(last.keys)} blocks, "
          f"{len(last.own)} its own); the others: {work.requests - len(work.conversations[victim])}"
          " requests of the other conversations")  # fmt: skip
    ratios50, ratios99, base99, stall99, victim_waits = [], [], [], [], []
    for r in range(args.stall_rounds):
        pair: dict[bool, Run] = {}
        for stalled in (False, True) if r % 2 == 0 else (True, False):
            root = tmp / f"stall-{int(stalled)}-{r}"
            root.mkdir(mode=0o700)
            pair[stalled] = await replay(
                "prefetch", work, kv, args, root,
                stall=args.stall if stalled else 0.0, victim=victim,
            )  # fmt: skip
            shutil.rmtree(root)
        calm, hit = pair[False], pair[True]
        p50c, p50s = calm.quantile(0.5, victim), hit.quantile(0.5, victim)
        p99c, p99s = calm.quantile(0.99, victim), hit.quantile(0.99, victim)
        key = (victim, len(work.conversations[victim]) - 1)
        victim_waits.append(hit.waits.get(key, math.nan))
        ratios50.append(p50s / p50c)
        ratios99.append(p99s / p99c)
        base99.append(p99c)
        stall99.append(p99s)
        print(
            f"round {r + 1}: others p50 {ms(p50c)} -> {ms(p50s)} ms, p99 {ms(p99c)} -> "
            f"{ms(p99s)} ms ({p99s / p99c:.2f}x); stalled request waited "
            f"{victim_waits[-1]:.2f} s; stalls fired {hit.stalls} (without: {calm.stalls}); "
            f"{describe(hit)}",
            flush=True,
        )
    r99 = statistics.median(ratios99)
    print("\n| others' wait | without stall ms | with stall ms | with/without |")
    print("|---|---|---|---|")
    print(
        f"| p99 | {ms(statistics.median(base99))} | {ms(statistics.median(stall99))} | {r99:.2f}x |"
    )
    print(f"| p50 ratio | | | {statistics.median(ratios50):.2f}x |")
    print(f"\nthe stalled request itself waited {statistics.median(victim_waits):.2f} s (median)")
    print(
        f"target: the stall raises the others' p99 wait by at most 10%: "
        f"{'met' if r99 <= 1.10 else 'NOT met'}"
    )


async def main(args: argparse.Namespace) -> None:
    logging.getLogger("aiokvo.offloader").setLevel(logging.ERROR)  # refusals are counted
    work = build_workload(args)
    kv = kv_caches(args.gpu_blocks, args.block_kib << 10)
    load = os.getloadavg()
    print(
        f"# Agentic replay: {len(work.conversations)} conversations, {work.requests} requests, "
        f"{work.distinct_blocks} distinct blocks of {args.block_kib} KiB; CPU pool "
        f"{args.pool} blocks; nproc {os.cpu_count()}; load average {load[0]:.2f}"
    )
    print(
        f"scheduling delay {args.sched_ms[0]:g}-{args.sched_ms[1]:g} ms, pauses median "
        f"{args.pause:g} s, prefetch deadline {args.deadline:g} s, retain ttl {args.ttl:g} s\n"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as name:
        tmp = Path(name)
        if args.only in (None, "modes"):
            runs = await compare_modes(work, kv, args, tmp)
            print_modes(runs, args.rounds)
        if args.stall > 0 and args.only in (None, "stall"):
            await compare_stall(work, kv, args, tmp)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trace", default=None, help=f"the {TRACE_NAME} to replay")
    parser.add_argument("--dir", default=None, help="where the disk tiers live (default: /tmp)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--min-turns", type=int, default=3)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=128)
    parser.add_argument("--pool", type=int, default=256, help="CPU pool blocks")
    parser.add_argument("--gpu-blocks", type=int, default=1024)
    parser.add_argument("--sched-ms", type=float, nargs=2, default=(5.0, 40.0))
    parser.add_argument("--pause", type=float, default=0.8, help="median tool-call seconds")
    parser.add_argument(
        "--stagger", type=float, default=5.0, help="seconds over which conversations start"
    )
    parser.add_argument("--deadline", type=float, default=1.0, help="prefetch deadline")
    parser.add_argument("--ttl", type=float, default=5.0, help="retention ttl")
    parser.add_argument("--stall", type=float, default=10.0, help="seconds; 0: skip")
    parser.add_argument("--stall-rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--only", choices=("modes", "stall"), default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.stall_rounds, args.pool = 1, 40, 1, 64
        args.pause, args.stagger, args.stall = 0.2, 0.5, min(args.stall, 0.5)
    return args


if __name__ == "__main__":
    aiokvo.run(main(parse()))
