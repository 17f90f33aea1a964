"""vLLM's side of bench_kv_events.py: its ZmqEventPublisher replays a recorded stream.

Runs in vLLM's own interpreter (``--peer``), never imports aiokvo. Reads the
pickled stream (a list of steps, each a list of ``(removed, keys)``), builds
vLLM's own ``OffloadingEvent``s up front, prints the PUB endpoint, waits for
``go`` on stdin, then times what vLLM's scheduler and publisher thread do for
offload events in a step: ``OffloadingEventsTracker.take_events`` (vLLM's
translation into KV events, placeholder payloads as by default), one
``KVEventBatch`` per step, ``publish()``; the clock stops when the publisher
thread has sent every batch (``Queue.join``). Prints one JSON line.
"""

from __future__ import annotations

import json
import pickle
import sys
import time


def main() -> int:
    stream_path, port = sys.argv[1], int(sys.argv[2])
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadingKVEventsConfig

    with open(stream_path, "rb") as f:
        steps = pickle.load(f)
    vllm_steps = [[OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed)
                   for removed, keys in step] for step in steps]
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False))
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    print(json.dumps({"ready": True}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    batches = events = hashes = 0
    start = time.perf_counter()
    for step in vllm_steps:
        kv_events = list(tracker.take_events(step))
        if kv_events:
            publisher.publish(KVEventBatch(ts=time.time(), events=kv_events))
            batches += 1
            events += len(kv_events)
            hashes += sum(len(e.block_hashes) for e in kv_events)
    submitted = time.perf_counter() - start
    publisher._event_queue.join()  # every batch encoded and sent by the publisher thread
    elapsed = time.perf_counter() - start
    publisher.shutdown()
    print(json.dumps({"seconds": elapsed, "submit_seconds": submitted, "batches": batches,
                      "events": events, "hashes": hashes}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
