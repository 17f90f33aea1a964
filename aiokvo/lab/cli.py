"""``aiokvo replay``: hit rate against pool size for every policy, beside Belady's bound."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from aiokvo.errors import ConfigError, TraceFormatError, UnknownPolicyError
from aiokvo.lab.belady import belady_hits
from aiokvo.lab.plot import EXTRA
from aiokvo.lab.replay import ReplayResult, TierModel, capacity_blocks, replay
from aiokvo.lab.trace import Trace, read_trace
from aiokvo.manager.policies.registry import BUILTIN_POLICIES, resolve_policy

__all__ = ["add_replay_command", "result_row", "run_replay"]

DEFAULT_CAPACITIES = (0.01, 0.02, 0.05, 0.1)

_EPILOG = """examples:
  aiokvo replay trace.jsonl --policy all --capacity 0.01 0.02 0.05 0.1 --json
  aiokvo replay trace.jsonl --policy lru chain --plot hit-rates.png
  aiokvo replay trace.jsonl --policy chain --capacity 0.05 --tiers disk=0.5 --block-bytes 2097152

The trace is JSON lines in the Mooncake FAST'25 format (timestamp, input_length,
output_length, hash_ids), as aiokvo.lab.record.TraceRecorder writes them.
"""


def add_replay_command(commands: Any) -> None:
    """Register ``replay`` on an ``argparse`` subparsers object."""
    parser = commands.add_parser(
        "replay", help="replay a request trace through every cache policy",
        description="Replay a request trace through the CPU manager under each policy and "
                    "pool size; print the hit rate beside Belady's offline optimum.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("trace", help="a JSONL trace file (Mooncake FAST'25 format)")
    parser.add_argument("--policy", nargs="+", default=["all"], metavar="NAME",
                        help="policy names or module paths, or 'all' (default: all "
                             f"registered: {', '.join(BUILTIN_POLICIES)})")  # fmt: skip
    parser.add_argument("--capacity", nargs="+", type=float, default=list(DEFAULT_CAPACITIES),
                        metavar="F", help="pool sizes as shares of the trace's distinct "
                        "blocks, in (0, 1] (default: 0.01 0.02 0.05 0.1)")  # fmt: skip
    parser.add_argument("--tiers", nargs="+", default=[], metavar="NAME=F",
                        help="tiers below the pool, top first, each NAME=share of the "
                             "distinct blocks (e.g. disk=0.5): write-through, read on a "
                             "pool miss; blocks (and bytes) counted per tier")  # fmt: skip
    parser.add_argument("--block-bytes", type=int, default=None, metavar="N",
                        help="bytes per block, to report bytes moved as well as blocks")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per line per (policy, capacity)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help=f"also draw the hit-rate curves (needs aiokvo[{EXTRA}])")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (default: when stderr is a terminal)")
    parser.set_defaults(handler=run_replay)


def run_replay(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the command for parsed ``args``; the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr
    try:
        plan = _plan(args)
    except (ConfigError, UnknownPolicyError) as exc:
        err.write(f"aiokvo replay: {exc}\n")
        return 2
    try:
        trace = read_trace(args.trace)
    except (OSError, TraceFormatError) as exc:
        err.write(f"aiokvo replay: {exc}\n")
        return 2
    policies, fractions, tier_shares = plan
    distinct = trace.distinct_blocks
    show = err.isatty() if args.progress is None else args.progress
    rows: list[dict[str, Any]] = []
    if not args.json:
        _header(out, bool(tier_shares))
    for fraction in fractions:
        blocks = capacity_blocks(fraction, distinct)
        bound = belady_hits(trace.requests, blocks)
        tiers = [TierModel(name.upper(), capacity_blocks(share, distinct))
                 for name, share in tier_shares]  # fmt: skip
        for policy in policies:
            bar = _Bar(err, f"{policy} @ {fraction:g}", trace) if show else None
            result = replay(trace.keys, policy, blocks, tiers=tiers,
                            progress=bar.update if bar else None)  # fmt: skip
            if bar:
                bar.close()
            row = result_row(result, fraction, bound.hit_rate, args.block_bytes)
            rows.append(row)
            if args.json:
                out.write(json.dumps(row) + "\n")
            else:
                _line(out, row)
            out.flush()
    if args.plot:
        from aiokvo.lab.plot import plot_hit_rates

        name = os.path.basename(args.trace)
        plot_hit_rates(rows, args.plot, title=f"{name}: {len(trace)} requests, "
                                              f"{trace.references} block references")  # fmt: skip
        err.write(f"aiokvo replay: wrote {args.plot}\n")
    return 0


def result_row(
    result: ReplayResult, fraction: float, belady_hit_rate: float, block_bytes: int | None
) -> dict[str, Any]:
    """The JSON object for one replay."""
    row: dict[str, Any] = {
        "policy": result.policy,
        "capacity_fraction": fraction,
        "capacity_blocks": result.capacity_blocks,
        "hit_rate": round(result.hit_rate, 6),
        "belady_hit_rate": round(belady_hit_rate, 6),
        "of_belady": round(result.hit_rate / belady_hit_rate, 4) if belady_hit_rate else None,
        "requests": result.requests,
        "references": result.references,
        "hits": result.hits,
        "blocks_stored": result.blocks_stored,
        "blocks_evicted": result.blocks_evicted,
        "stores_refused": result.stores_refused,
        "seconds": round(result.seconds, 3),
        "cpu_seconds": round(result.cpu_seconds, 3),
        "references_per_second": round(result.references_per_second),
    }
    if block_bytes is not None:
        row["bytes_to_pool"] = result.blocks_stored * block_bytes
        row["bytes_from_pool"] = result.hits * block_bytes
    if result.tiers:
        tiers = []
        for tier in result.tiers:
            entry: dict[str, Any] = {
                "name": tier.name,
                "capacity_blocks": tier.capacity_blocks,
                "hit_rate": round(tier.hits / result.references, 6) if result.references else 0,
                "blocks_written": tier.blocks_written,
                "blocks_read": tier.blocks_read,
                "blocks_evicted": tier.blocks_evicted,
            }
            if block_bytes is not None:
                entry["bytes_written"] = tier.blocks_written * block_bytes
                entry["bytes_read"] = tier.blocks_read * block_bytes
            tiers.append(entry)
        row["tiers"] = tiers
    return row


def _plan(args: argparse.Namespace) -> tuple[list[str], list[float], list[tuple[str, float]]]:
    """Check every option before reading the trace; ConfigError names the bad one."""
    names: list[str] = []
    for name in args.policy:
        for one in BUILTIN_POLICIES if name == "all" else [name]:
            resolve_policy(one)
            if one not in names:
                names.append(one)
    for fraction in args.capacity:
        capacity_blocks(fraction, 1)
    tiers: list[tuple[str, float]] = []
    for spec in args.tiers:
        name, sep, share = spec.partition("=")
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if not sep or not name.isidentifier() or not 0 < value <= 1:
            raise ConfigError(f"--tiers takes NAME=SHARE with SHARE in (0, 1], got {spec!r}")
        tiers.append((name, value))
    if args.block_bytes is not None and args.block_bytes <= 0:
        raise ConfigError(f"--block-bytes must be positive, got {args.block_bytes}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"--plot needs matplotlib: pip install 'aiokvo[{EXTRA}]'")
    return names, list(args.capacity), tiers


def _header(out: TextIO, tiers: bool) -> None:
    extra = "  below (hit rate per tier)" if tiers else ""
    out.write(f"{'policy':<12} {'capacity':>9} {'blocks':>8} {'hit rate':>9} "
              f"{'Belady':>8} {'of Belady':>9} {'refs/s':>9}{extra}\n")  # fmt: skip


def _line(out: TextIO, row: dict[str, Any]) -> None:
    share = row["of_belady"]
    below = "  " + " ".join(f"{t['name']} {100 * t['hit_rate']:.1f}%" for t in row.get("tiers", []))
    out.write(
        f"{row['policy']:<12} {100 * row['capacity_fraction']:>8.3g}% "
        f"{row['capacity_blocks']:>8} {100 * row['hit_rate']:>8.2f}% "
        f"{100 * row['belady_hit_rate']:>7.2f}% "
        f"{'-' if share is None else f'{share:.2f}':>9} "
        f"{row['references_per_second'] / 1000:>8.0f}k{below.rstrip()}\n"
    )


class _Bar:
    """A one-line progress bar on a terminal, redrawn at most ten times a second."""

    def __init__(self, stream: TextIO, label: str, trace: Trace) -> None:
        self._stream = stream
        self._label = label
        self._refs_per_request = trace.references / max(1, len(trace))
        self._started = self._drawn = time.perf_counter()
        self._clock: Callable[[], float] = time.perf_counter

    def update(self, done: int, total: int) -> None:
        now = self._clock()
        if now - self._drawn < 0.1 and done < total:
            return
        self._drawn = now
        width = 30
        filled = width * done // max(1, total)
        rate = done * self._refs_per_request / max(now - self._started, 1e-9)
        percent = 100 * done // max(1, total)
        self._stream.write(f"\r{self._label:<18} [{'#' * filled}{'.' * (width - filled)}] "
                           f"{percent:3d}%  {rate / 1000:6.0f}k refs/s")  # fmt: skip
        self._stream.flush()

    def close(self) -> None:
        self._stream.write("\r\033[K")
        self._stream.flush()
