"""Replay a bench_manager.py trace on vLLM's CPUOffloadingManager (the peer).

Run with the peer's Python (``.vllm-venv/bin/python``, ``make .vllm-venv``), not aiokvo's: it
imports only numpy and vLLM. bench_manager.py calls it with ``--peer`` and
reads one JSON object per line from stdout.

The per-request calls mirror bench_manager.py exactly. vLLM 0.32 also
expects ``on_new_request``/``on_request_finished`` around each request (its
scheduler makes them); ``--lifecycle`` adds them, which is what a real vLLM
run pays. Without it the replay is the bare manager calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager


def load_trace(path: str) -> tuple[list[list[bytes]], list[int], int]:
    data = np.load(path)
    hashes = data["hashes"]
    suffix = b"\x00\x00\x00\x00"
    keys = [bytes(row) + suffix for row in hashes]
    sequences = [[keys[i] for i in row] for row in data["sequences"].tolist()]
    return sequences, data["requests"].tolist(), int(data["capacity"])


def replay(
    sequences: list[list[bytes]], requests: list[int], capacity: int, policy: str,
    lifecycle: bool,
) -> dict[str, float]:
    manager = CPUOffloadingManager(capacity, cache_policy=policy)
    hit = LookupResult.HIT
    hits_total = 0
    keys_total = 0
    gc.collect()
    start = time.perf_counter()
    for i, seq_idx in enumerate(requests):
        keys = sequences[seq_idx]
        ctx = ReqContext(req_id=str(i))
        if lifecycle:
            manager.on_new_request(ctx)
        hits = 0
        for key in keys:
            if manager.lookup(key, ctx) is not hit:
                break
            hits += 1
        if hits:
            loaded = keys[:hits]
            manager.prepare_load(loaded, ctx)
            manager.complete_load(loaded, ctx)
        out = manager.prepare_store(keys[hits:], ctx)
        manager.touch(keys, ctx)
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
        if lifecycle:
            manager.on_request_finished(ctx)
        hits_total += hits
        keys_total += len(keys)
    elapsed = time.perf_counter() - start
    return {
        "req_per_s": len(requests) / elapsed,
        "us_per_req": elapsed / len(requests) * 1e6,
        "hit_rate": hits_total / keys_total,
    }


def bytes_per_block(capacity: int, policy: str) -> float:
    keys = [i.to_bytes(32, "big") + b"\x00\x00\x00\x00" for i in range(capacity)]
    batches = [keys[i : i + 64] for i in range(0, capacity, 64)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    manager = CPUOffloadingManager(capacity, cache_policy=policy)
    ctx = ReqContext(req_id="fill")
    for batch in batches:
        out = manager.prepare_store(batch, ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
    del out, ctx
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / capacity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace")
    parser.add_argument("--policy", action="append", required=True)
    parser.add_argument("--lifecycle", action="store_true")
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    sequences, requests, capacity = load_trace(args.trace)
    for policy in args.policy:
        result = replay(sequences, requests, capacity, policy, args.lifecycle)
        result["policy"] = policy  # type: ignore[assignment]
        if args.memory:
            result["bytes_per_block"] = bytes_per_block(capacity, policy)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
