"""A whole vLLM engine (0.32's CPU build) with and without aiokvo's CPU pool, alternated.

The same prefix-heavy workload (``tests/integrations/vllm/engine.py``:
``--docs`` shared prefixes of ``--prefix`` tokens, each request one prefix
and a short question, sent in rounds of ``--round-size`` that cycle
through the prefixes) against a GPU KV cache smaller than the prefixes
together, through ``vllm.LLM`` with a random-weight Llama of the given
size. Each configuration runs in a fresh process per round; rounds
alternate the order. Reported per configuration (median over rounds):
throughput (prompt + generated tokens per second of ``generate``), time to
first token p50/p99 (a round's requests all arrive at once, so TTFT
includes their queueing), prefill tokens computed, tokens loaded from the
pool (external prefix-cache hits: the recompute saved), preemptions, and
vLLM's ``kv_offload_lookup_sync_delay_seconds`` histogram (``lookups_delayed``
is its count, ``lookup_delay_mean_ms`` its mean).

Configurations:

* ``none``: no KV connector.
* ``aiokvo``: vLLM's OffloadingConnector with aiokvo's spec (CPU pool).
* ``aiokvo+disk``: aiokvo's CPU pool over a disk tier (``aiokvo_tiers``),
  measured **after a restart**: an engine first serves the workload on a
  fresh root and exits (not timed), then a new engine on the same root is
  measured, its pool empty and its disk full (``loaded_from_disk``: blocks
  the tier read back).

    PYTHONPATH=. .vllm-venv/bin/python benchmarks/bench_vllm_engine.py \\
        [--rounds 2] [--requests 240] [--prefix 512] [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integrations.vllm.engine import (
    AIOKVO,
    Run,
    Workload,
    run_in_subprocess,
    write_tiny_llama,
)

CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "aiokvo": dict(AIOKVO),
    "aiokvo+disk": dict(AIOKVO),  # plus aiokvo_tiers (a root per round), after a restart
}
RESTARTED = {"aiokvo+disk"}


def disk_tier(root: Path) -> dict[str, Any]:
    return {"aiokvo_tiers": [{"kind": "disk", "root": str(root), "capacity_bytes": 8 << 30}]}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(result: dict[str, Any], workload: Workload) -> dict[str, float]:
    m = result["metrics"]
    prompt = float(result["prompt_tokens"])
    generated = float(sum(len(t) for t in result["tokens"]))
    hits = float(m.get("vllm:external_prefix_cache_hits", 0.0))
    gpu_hits = float(m.get("vllm:prefix_cache_hits", 0.0))
    queried = float(m.get("vllm:prompt_tokens", prompt))
    delay_n = float(m.get("vllm:kv_offload_lookup_sync_delay_seconds:count", 0.0))
    delay_s = float(m.get("vllm:kv_offload_lookup_sync_delay_seconds:sum", 0.0))
    return {
        "seconds": result["seconds"],
        "tokens_per_s": (prompt + generated) / result["seconds"],
        "ttft_p50_ms": percentile(result["ttft"], 0.50) * 1e3,
        "ttft_p99_ms": percentile(result["ttft"], 0.99) * 1e3,
        "prefill_computed": queried - hits - gpu_hits,
        "loaded_from_pool": hits,
        "gpu_prefix_hits": gpu_hits,
        "preemptions": float(m.get("vllm:num_preemptions", 0.0)),
        "lookups_delayed": delay_n,
        "lookup_delay_mean_ms": delay_s / delay_n * 1e3 if delay_n else 0.0,
        "loaded_from_disk": float(m.get("vllm:kv_offload_aiokvo_tier_blocks_read", 0.0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--prefix", type=int, default=512, help="shared prefix tokens")
    ap.add_argument("--round-size", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--gpu-kv-tokens", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--json", action="store_true", help="also print the raw summaries")
    args = ap.parse_args()
    workload = Workload(docs=args.docs, prefix_tokens=args.prefix, requests=args.requests,
                        round_size=args.round_size, max_tokens=args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(Path(tmp) / "llama", hidden=args.hidden, layers=args.layers,
                                 heads=args.heads, kv_heads=args.kv_heads,
                                 intermediate=args.intermediate)
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            names = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                extra = disk_tier(Path(tmp) / f"disk-{r}") if name in RESTARTED else {}
                run = Run(model=str(model), workload=workload, spec=CONFIGS[name],
                          gpu_kv_tokens=args.gpu_kv_tokens, max_num_seqs=args.max_num_seqs,
                          extra_config=extra)
                if name in RESTARTED:  # the engine before the restart fills the disk
                    run_in_subprocess(run, Path(tmp) / f"{name}-first", timeout=3600)
                result = run_in_subprocess(run, Path(tmp) / name, timeout=3600)
                rows[name].append(summarize(result, workload))
                tokens.setdefault(name, result["tokens"])
                print(f"  round {r} {name}: {json.dumps(rows[name][-1])}", flush=True)
    load = os.getloadavg()[0]
    print(f"\nvLLM engine, {args.requests} requests over {args.docs} prefixes of {args.prefix} "
          f"tokens (rounds of {args.round_size}, max_num_seqs {args.max_num_seqs}), GPU KV "
          f"{args.gpu_kv_tokens} tokens, Llama hidden {args.hidden} x "
          f"{args.layers} layers; median of {args.rounds} alternated rounds; load average "
          f"{load:.1f} on {os.cpu_count()} CPUs")
    keys = list(next(iter(rows.values()))[0])
    print(f"  {'':24s}" + "".join(f"{name:>14s}" for name in rows))
    med = {name: {k: statistics.median(x[k] for x in rows[name]) for k in keys} for name in rows}
    for k in keys:
        print(f"  {k:24s}" + "".join(f"{med[name][k]:14.1f}" for name in rows))
    base = med["none"]
    for name in rows:
        if name == "none":
            continue
        paired = statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rows[name], rows["none"],
                                                                  strict=True)
        )
        print(f"  {name}: throughput {paired:.2f}x of none (paired), TTFT p99 "
              f"{med[name]['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x, prefill computed "
              f"{base['prefill_computed'] / max(med[name]['prefill_computed'], 1):.1f}x fewer; "
              f"tokens identical to none: {tokens[name] == tokens['none']}")
    if args.json:
        print(json.dumps({"rows": rows, "median": med}))


if __name__ == "__main__":
    main()
