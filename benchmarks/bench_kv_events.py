"""KV-event publishing: aiokvo's KVEventPublisher vs vLLM's ZmqEventPublisher, same stream.

Two sections, each measured side by side in one run:

1. **Events per second.** bench_manager.py's trace (prefix-tree sequences of
   64 keys, Zipf popularity) drives a CPUOffloadingManager warmed to steady
   state; its events are recorded in steps of ``--requests-per-step``
   requests (one scheduler step, one batch). Both publishers then replay that
   stream to a SUB consumer in another process on loopback:

   * aiokvo: the events are pushed into the publisher's subscription as the
     manager pushes them, the loop yields once per step, and the publisher
     translates, encodes and sends one batch per step; the clock stops when
     it has sent everything (``flush()``).
   * vLLM 0.32 (``--peer PYTHON``, its own venv): what its scheduler does for
     offload events per step (``OffloadingEventsTracker.take_events``, one
     ``KVEventBatch``, ``publish()``) and its publisher thread (encode, send);
     the clock stops when the thread has sent every batch.

   Both publish placeholder stores (vLLM's default, no request metadata);
   aiokvo puts a step's stores of one group in one event, vLLM one event per
   key, so the table reports KV events, block hashes and wall time for the
   whole stream. The consumer checks every batch arrived (no seq gap).

2. **The publisher's cost to the loop.** Managers replay the same
   steady-state requests in lockstep rounds, rotating which goes first
   (``--sides`` picks them; the first is the baseline): nobody subscribed
   ("off"); a bare subscription drained each step (the manager's own cost of
   making events); a ``KVEventPublisher`` (placeholder events; its writer
   thread translates, encodes and sends); one with ``describe(keys, ctx,
   only=keys_to_store)`` per stored request; one with ``thread=False``
   (all of the publisher's work on the loop, as before issue 22); and what a
   competent engineer writes with msgspec and pyzmq directly
   (:class:`DirectPublisher`: vLLM's design, a queue per step and a thread
   that encodes structs with msgspec and sends). The scheduler awaits
   ``sleep(0)`` between steps; the loop thread's CPU time (``--clock``) is
   timed for the requests ("scheduler") and between steps (what the loop
   runs there), and the cost is the median of the rounds' paired ratios of
   the total against "off". Wall time and the writer thread's CPU time are
   reported beside it: on two busy cores the thread's work shares the GIL
   and the cores with the loop. ``--manager-steps`` sets the requests per
   step (a real engine step carries tens to hundreds).

    python benchmarks/bench_kv_events.py --peer /path/to/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import pickle
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_manager import SEQ_LEN, Trace, warm_up

import aiokvo
from aiokvo.events import EventSubscription
from aiokvo.keys import OffloadKey
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.sink import EventSink, OverflowPolicy
from aiokvo.specs import BlockMetadata, OffloadingEvent, ReqContext
from aiokvo.telemetry.kv_events import KVEventPublisher

PEER_SCRIPT = Path(__file__).with_name("_peer_kv_events.py")
TOKENS_PER_KEY = 16

Step = list[tuple[bool, list[bytes]]]


# -- the stream ------------------------------------------------------------------------


def record_stream(trace: Trace, policy: str, requests_per_step: int,
                  warm_chunk: int) -> list[Step]:
    """The events a steady-state manager makes, grouped by step."""
    sequences, requests = trace.key_lists(), trace.requests.tolist()
    manager = CPUOffloadingManager(trace.capacity, policy)
    warm, _ = warm_up(manager, sequences, requests, warm_chunk, 0.005)
    ctx = ReqContext()
    sink_steps: list[Step] = []
    sub = manager.subscribe(maxsize=1 << 20)
    for start in range(warm, len(requests), requests_per_step):
        for seq_idx in requests[start : start + requests_per_step]:
            run_request(manager, sequences[seq_idx], ctx)
        items = sub.drain_nowait()
        assert all(isinstance(item, OffloadingEvent) for item in items)
        sink_steps.append([(e.removed, list(e.keys)) for e in items
                           if isinstance(e, OffloadingEvent)])
    sub.close()
    return sink_steps


def run_request(manager: CPUOffloadingManager, keys: list[OffloadKey], ctx: ReqContext,
                publisher: KVEventPublisher | None = None) -> None:
    """bench_manager.py's request (``lookup_prefix`` form)."""
    hits = manager.lookup_prefix(keys, ctx) or 0
    if hits:
        loaded = keys[:hits]
        manager.prepare_load(loaded, ctx)
        manager.complete_load(loaded)
    out = manager.prepare_store(keys[hits:], ctx)
    manager.touch(keys)
    if out is not None and out.keys_to_store:
        if publisher is not None:
            publisher.describe(keys, ctx, only=out.keys_to_store)
        manager.complete_store(out.keys_to_store)


# -- the consumer (a separate process) -------------------------------------------------


def consume(endpoint: str, expect: int, idle: float) -> int:
    """SUB side: receive ``expect`` batches (or stop after ``idle`` s of silence)."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    print(json.dumps({"connected": True}), flush=True)
    payloads: list[bytes] = []
    seqs: list[int] = []
    first = last = 0.0
    while expect < 0 or len(payloads) < expect:
        # The first batch may be a while: on a loaded box the other consumers start first.
        if not sock.poll(int((idle if payloads else max(idle, 60.0)) * 1000)):
            break
        _, seq, payload = sock.recv_multipart()
        last = time.perf_counter()
        first = first or last
        seqs.append(int.from_bytes(seq, "big"))
        payloads.append(payload)
    decoder = msgspec.msgpack.Decoder()
    events = sum(len(decoder.decode(p)[1]) for p in payloads)
    gaps = sum(1 for a, b in itertools.pairwise(seqs) if b != a + 1)
    print(json.dumps({"received": len(payloads), "events": events, "gaps": gaps,
                      "first_seq": seqs[0] if seqs else None, "seconds": last - first}),
          flush=True)
    sock.close(linger=0)
    ctx.term()
    return 0


class Consumer:
    """A consumer subprocess in this interpreter."""

    def __init__(self, endpoint: str, expect: int, idle: float = 2.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--consume", endpoint, "--expect", str(expect),
             "--idle", str(idle)],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = json.loads(self.proc.stdout.readline())
        assert line == {"connected": True}, line

    def result(self) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=120)
        return dict(json.loads(out.strip().splitlines()[-1]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- section 1: events per second ------------------------------------------------------


class SinkSource:
    """A publisher source fed by hand: what a manager's subscribe() gives."""

    def __init__(self) -> None:
        self.sink = EventSink(record=False)

    def subscribe(self, *, maxsize: int = 1024,
                  overflow: OverflowPolicy = "drop_oldest") -> EventSubscription:
        return EventSubscription(self.sink, maxsize=maxsize, overflow=overflow)


@dataclass
class Run:
    seconds: float
    batches: int
    events: int
    hashes: int
    consumer: dict[str, Any]


async def run_aiokvo(steps: list[list[OffloadingEvent]], batches: int, settle: float) -> Run:
    source = SinkSource()
    publish = source.sink.publish
    # The whole stream is pushed as fast as the loop can: with the publisher's work on
    # its thread the pushes outrun it, so the subscription holds the stream (vLLM's
    # side queues up to 100,000 batches by default) and nothing is dropped.
    async with KVEventPublisher(source, "tcp://127.0.0.1:0", max_queue=1 << 20) as publisher:
        consumer = Consumer(publisher.endpoint, batches)
        await asyncio.sleep(settle)  # the SUB's subscription reaches the PUB
        gc.collect()
        start = time.perf_counter()
        for step in steps:
            for event in step:
                publish(event)
            await asyncio.sleep(0)  # the scheduler awaits between steps
        await publisher.flush()
        elapsed = time.perf_counter() - start
        stats = publisher.statistics()
        result = consumer.result()
    hashes = sum(len(e.keys) for step in steps for e in step)
    return Run(elapsed, stats.batches_sent, stats.events_sent, hashes, result)


def run_vllm(python: str, stream_path: str, batches: int, settle: float) -> Run:
    port = free_port()
    proc = subprocess.Popen([python, str(PEER_SCRIPT), stream_path, str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    assert ready == {"ready": True}, ready
    consumer = Consumer(f"tcp://127.0.0.1:{port}", batches)
    time.sleep(settle)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    row = json.loads(proc.stdout.readline())
    proc.wait(timeout=60)
    return Run(row["seconds"], row["batches"], row["events"], row["hashes"], consumer.result())


def events_section(args: argparse.Namespace) -> None:
    trace = Trace.generate(args.capacity, args.warm_requests + args.requests, args.seed)
    t0 = time.perf_counter()
    steps = record_stream(trace, args.policy, args.requests_per_step,
                          max(10_000, args.capacity // 20))
    steps = [s for s in steps if s][: args.requests // args.requests_per_step]
    batches = len(steps)
    keys_total = sum(len(k) for s in steps for _, k in s)
    print(f"# stream: {batches:,} non-empty steps of {args.requests_per_step} requests, "
          f"{sum(len(s) for s in steps):,} manager events, {keys_total:,} keys "
          f"(recorded in {time.perf_counter() - t0:.1f}s)")
    aiokvo_steps = [[OffloadingEvent([OffloadKey(k) for k in keys], "CPU", removed)
                     for removed, keys in step] for step in steps]
    with tempfile.TemporaryDirectory() as tmp:
        stream_path = os.path.join(tmp, "stream.pkl")
        with open(stream_path, "wb") as f:
            pickle.dump(steps, f, protocol=5)
        runs: dict[str, list[Run]] = {"aiokvo": [], "vLLM 0.32": []}
        for _ in range(args.repeat):
            runs["aiokvo"].append(aiokvo.run(run_aiokvo(aiokvo_steps, batches, args.settle)))
            if args.peer:
                runs["vLLM 0.32"].append(run_vllm(args.peer, stream_path, batches, args.settle))
    print()
    print(f"Same stream, best of {args.repeat} interleaved rounds (wall time to publish "
          "it all; consumer = a SUB in another process):")
    print("| publisher | seconds | batches/s | manager events/s | block hashes/s | "
          "KV events sent | consumer got | gaps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    best: dict[str, Run] = {}
    manager_events = sum(len(s) for s in steps)
    for name, rs in runs.items():
        if not rs:
            continue
        r = best[name] = min(rs, key=lambda r: r.seconds)
        got = r.consumer
        print(f"| {name} | {r.seconds:.3f} | {r.batches / r.seconds:,.0f} | "
              f"{manager_events / r.seconds:,.0f} | {r.hashes / r.seconds:,.0f} | "
              f"{r.events:,} | {got['received']:,}/{r.batches:,} | {got['gaps']} |")
    if "vLLM 0.32" in best:
        ours, peer = best["aiokvo"], best["vLLM 0.32"]
        print(f"\n  speed-up, same stream (vLLM seconds / aiokvo seconds): "
              f"{peer.seconds / ours.seconds:.2f}x  (per round: "
              + ", ".join(f"{p.seconds / o.seconds:.2f}x" for o, p in
                          zip(runs["aiokvo"], runs["vLLM 0.32"], strict=True)) + ")")
        print("  (vLLM sends one placeholder BlockStored per key, aiokvo one per group and "
              "step: the same hashes)")


# -- section 2: manager cost -----------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One manager of the cost section and what its events go to."""

    name: str
    publisher: dict[str, Any] | None = None  # KVEventPublisher options; None: no publisher
    subscribed: bool = False
    describe: bool = False
    direct: bool = False  # DirectPublisher instead of a KVEventPublisher


SIDES = (
    Side("off"),
    Side("subscribed", subscribed=True),
    Side("publisher", {}),
    Side("publisher+describe", {}, describe=True),
    Side("publisher on the loop (thread=False)", {"thread": False}),
    Side("msgspec+pyzmq direct", direct=True),
)


@dataclass
class DirectStatistics:
    batches_sent: int
    events_sent: int
    events_dropped: int = 0
    described_keys: int = 0


class DirectPublisher:
    """What a competent engineer writes with msgspec and pyzmq directly: vLLM's design.

    Each scheduler step drains the manager's subscription into a queue
    (:meth:`step`, on the loop); a thread makes one msgspec struct per
    event (each key's 64-bit hash and its group, as aiokvo publishes them),
    encodes the batch with a ``msgspec.msgpack.Encoder`` and sends it with
    ``send_multipart`` on a plain PUB socket. Placeholder stores only.
    """

    def __init__(self, manager: CPUOffloadingManager, max_queue: int = 16384) -> None:
        import queue
        import threading

        import zmq

        self._sub = manager.subscribe(maxsize=max_queue)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.set_hwm(100_000)
        self._sock.bind("tcp://127.0.0.1:0")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.thread = threading.Thread(target=self._run, name="direct-publisher", daemon=True)
        self._batches = self._events = 0

    async def __aenter__(self) -> DirectPublisher:
        self.thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._queue.put(None)
        await asyncio.to_thread(self.thread.join)
        self._sub.close()
        self._sock.close(linger=0)
        self._ctx.term()

    def step(self) -> None:
        items = self._sub.drain_nowait()
        if items:
            self._queue.put(items)

    async def flush(self) -> None:
        import threading

        done = threading.Event()
        self._queue.put(done)
        await asyncio.to_thread(done.wait)

    def statistics(self) -> DirectStatistics:
        return DirectStatistics(self._batches, self._events)

    def _run(self) -> None:
        import msgspec

        from aiokvo.telemetry.kv_wire import BlockRemoved, BlockStored, EventBatch

        encoder = msgspec.msgpack.Encoder()
        send = self._sock.send_multipart
        seq = 0
        while True:
            items = self._queue.get()
            if items is None:
                return
            if not isinstance(items, list):
                items.set()
                continue
            events: list[Any] = []
            for event in items:
                if not isinstance(event, OffloadingEvent) or not event.keys:
                    continue
                keys = event.keys
                hashes = [int.from_bytes(k[-12:-4], "big") for k in keys]
                group = int.from_bytes(keys[0][-4:], "big")
                if event.removed:
                    events.append(BlockRemoved(hashes, "CPU", group, "LOCAL"))
                else:
                    events.append(BlockStored(hashes, None, [], 0, None, "CPU", None, None,
                                              group, None, None, "LOCAL"))
            if not events:
                continue
            payload = encoder.encode(EventBatch(time.time(), events, 0))
            send((b"", seq.to_bytes(8, "big"), payload), copy=True)
            seq += 1
            self._batches += 1
            self._events += len(events)


def _thread_cpu(publisher: KVEventPublisher | DirectPublisher | None) -> float:
    """CPU seconds of ``publisher``'s writer thread so far (0 without one)."""
    if isinstance(publisher, DirectPublisher):
        thread = publisher.thread
    else:
        thread = None if publisher is None else publisher._writer._thread
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


async def manager_section(args: argparse.Namespace, per_step: int) -> dict[str, float]:
    """The publisher's cost to the loop; returns each side's median paired cost (ratio - 1)."""
    capacity, chunk = args.capacity, args.chunk
    chunk -= chunk % per_step
    trace = Trace.generate(capacity, args.warm_requests + args.paired_requests, args.seed + 1)
    sequences, requests = trace.key_lists(), trace.requests.tolist()
    contexts = [
        ReqContext(block_metadata=BlockMetadata(
            token_ids=list(range(i * SEQ_LEN * TOKENS_PER_KEY, (i + 1) * SEQ_LEN * TOKENS_PER_KEY)),
            block_size=TOKENS_PER_KEY))
        for i in range(len(sequences))
    ]
    sides = [s for s in SIDES if s.name in args.sides]
    managers = [CPUOffloadingManager(capacity, args.policy) for _ in sides]
    warm, _ = warm_up(managers[0], sequences, requests[: args.warm_requests],
                      max(10_000, capacity // 20), 0.005)
    for manager in managers[1:]:
        warm_up(manager, sequences, requests[:warm], warm, 1.0)  # the same requests
    plain = ReqContext()
    subscriptions = [m.subscribe(maxsize=1 << 16) if s.subscribed else None
                     for s, m in zip(sides, managers, strict=True)]
    options: dict[str, Any] = {}
    if args.batch_interval is not None:
        options["batch_interval"] = args.batch_interval
    async with contextlib.AsyncExitStack() as stack:
        publishers: list[KVEventPublisher | DirectPublisher | None] = [
            await stack.enter_async_context(DirectPublisher(m)) if s.direct
            else None if s.publisher is None else await stack.enter_async_context(
                KVEventPublisher(m, "tcp://127.0.0.1:0", **options, **s.publisher))
            for s, m in zip(sides, managers, strict=True)
        ]
        live = [p for p in publishers if p is not None]
        interval = next((p._interval for p in live if isinstance(p, KVEventPublisher)), 0.0)
        consumers = [Consumer(p.endpoint, -1, idle=3.0) for p in live]
        await asyncio.sleep(args.settle)
        sched: list[list[float]] = [[] for _ in sides]
        loop_us: list[list[float]] = [[] for _ in sides]
        wall_us: list[list[float]] = [[] for _ in sides]
        writer_us: list[list[float]] = [[] for _ in sides]
        # The loop thread's CPU time: what the scheduler's thread spends, whatever else
        # the (shared) box runs; ZMQ's I/O thread and the consumer are other threads.
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        wall = time.perf_counter
        gc.collect()
        for n, start in enumerate(range(warm, warm + args.paired_requests - chunk + 1, chunk)):
            window = requests[start : start + chunk]
            order = list(range(len(sides)))
            order = order[n % len(order):] + order[: n % len(order)]  # rotate who goes first
            for i in order:
                side, manager, publisher = sides[i], managers[i], publishers[i]
                subscription = subscriptions[i]
                spent = pumped = 0.0
                w0, c0 = wall(), _thread_cpu(publisher)
                for s in range(0, chunk, per_step):
                    t0 = clock()
                    if side.describe:
                        for seq_idx in window[s : s + per_step]:
                            run_request(manager, sequences[seq_idx], contexts[seq_idx],
                                        publisher)
                    else:
                        for seq_idx in window[s : s + per_step]:
                            run_request(manager, sequences[seq_idx], plain)
                    t1 = clock()
                    if subscription is not None:
                        subscription.drain_nowait()
                    elif isinstance(publisher, DirectPublisher):
                        publisher.step()  # the step's events to its thread
                    # The scheduler awaits between steps (a real one awaits its model
                    # runner): whatever the loop runs meanwhile is counted as loop time.
                    await asyncio.sleep(0)
                    spent += t1 - t0
                    pumped += clock() - t1
                if publisher is not None:
                    t1 = clock()
                    await publisher.flush()  # what the chunk left queued, counted too
                    pumped += clock() - t1
                sched[i].append(spent / chunk * 1e6)
                loop_us[i].append(pumped / chunk * 1e6)
                wall_us[i].append((wall() - w0) / chunk * 1e6)
                writer_us[i].append((_thread_cpu(publisher) - c0) / chunk * 1e6)
        stats = [p.statistics() for p in live]
    for subscription in subscriptions:
        if subscription is not None:
            subscription.close()
    results = [c.result() for c in consumers]
    print()
    print(f"Cost to the loop at capacity {capacity:,} ({args.policy}), steps of {per_step} "
          f"requests, batch_interval {interval * 1e3:g} ms, {args.clock} time of the loop's "
          f"thread: {warm:,} warm-up requests each, then {len(sched[0])} rounds of "
          f"{chunk:,} requests per manager, the order rotating:")
    print("| events go to | scheduler µs/req | loop between steps µs/req | total µs/req | "
          "cost vs off (median of paired rounds) | rounds range | wall µs/req | wall vs off | "
          "writer thread CPU µs/req |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = [[a + b for a, b in zip(sched[i], loop_us[i], strict=True)]
              for i in range(len(sides))]
    costs: dict[str, float] = {}
    for i, side in enumerate(sides):
        med_total = statistics.median(totals[i])
        if i == 0:
            cost = spread = wall_cost = "-"
        else:
            ratios = [b / a - 1 for a, b in zip(totals[0], totals[i], strict=True)]
            costs[side.name] = statistics.median(ratios)
            cost = f"{costs[side.name] * 100:+.1f}%"
            q = statistics.quantiles(ratios, n=4)
            spread = f"{q[0] * 100:+.1f}% .. {q[2] * 100:+.1f}% (IQR)"
            walls = [b / a - 1 for a, b in zip(wall_us[0], wall_us[i], strict=True)]
            wall_cost = f"{statistics.median(walls) * 100:+.1f}%"
        print(f"| {side.name} | {statistics.median(sched[i]):.2f} | "
              f"{statistics.median(loop_us[i]):.2f} | {med_total:.2f} | {cost} | {spread} | "
              f"{statistics.median(wall_us[i]):.2f} | {wall_cost} | "
              f"{statistics.median(writer_us[i]):.2f} |")
    names = [s.name for s, p in zip(sides, publishers, strict=True) if p is not None]
    for name, st, res in zip(names, stats, results, strict=True):
        print(f"  # {name}: {st.batches_sent:,} batches, {st.events_sent:,} KV events sent, "
              f"{st.events_dropped} dropped, described keys left {st.described_keys}; "
              f"consumer got {res['received']:,} batches, {res['gaps']} gaps")
    return costs


# -- section 3: encoding a batch ------------------------------------------------------


def encode_section(args: argparse.Namespace) -> None:
    """``EventTranslator.encode`` (straight to msgpack) vs ``translate`` + msgspec's encoder
    (what the publisher did before), on the same batches, alternated, paired medians."""
    import msgspec

    from aiokvo.telemetry.kv_wire import EventBatch, EventTranslator

    trace = Trace.generate(args.capacity, args.warm_requests + 40_000, args.seed + 2)
    print("\nEncoding one batch (loop-thread CPU time per batch; paired rounds alternate "
          "which goes first):")
    print("| requests per batch | keys per batch | translate + msgspec µs | encode µs | "
          "ratio (median of paired) |")
    print("|---:|---:|---:|---:|---:|")
    for per_batch in (8, 16, 64, 256):
        steps = record_stream(trace, args.policy, per_batch, max(10_000, args.capacity // 20))
        batches = [[OffloadingEvent([OffloadKey(k) for k in keys], "CPU", removed)
                    for removed, keys in step] for step in steps if step][:1000]
        translator = EventTranslator()
        encoder = msgspec.msgpack.Encoder()

        def old(batch: list[OffloadingEvent], translator: EventTranslator = translator,
                encoder: msgspec.msgpack.Encoder = encoder) -> bytes:  # fmt: skip
            out: list[Any] = []
            for event in batch:
                translator.translate(event, out)
            return encoder.encode(EventBatch(0.0, out, 0))

        def new(batch: list[OffloadingEvent], translator: EventTranslator = translator) -> bytes:
            parts: list[bytes] = []
            translator.encode(batch, parts)
            return b"".join(parts)

        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.encode_rounds):
            pair = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            for name, fn in pair:
                t0 = time.thread_time()
                for batch in batches:
                    fn(batch)
                times[name].append((time.thread_time() - t0) / len(batches) * 1e6)
        ratios = [n / o for o, n in zip(times["old"], times["new"], strict=True)]
        keys = sum(len(e.keys) for b in batches for e in b) / len(batches)
        print(f"| {per_batch} | {keys:,.0f} | {statistics.median(times['old']):.1f} | "
              f"{statistics.median(times['new']):.1f} | {statistics.median(ratios):.2f}x |")


# -- main ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--peer", metavar="PYTHON", help="vLLM 0.32's interpreter")
    parser.add_argument("--capacity", type=int, default=10_000)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=80_000,
                        help="requests whose events make the stream (after warm-up)")
    parser.add_argument("--warm-requests", type=int, default=200_000)
    parser.add_argument("--requests-per-step", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds for a new SUB's subscription to reach the PUB")
    parser.add_argument("--paired-requests", type=int, default=100_000)
    parser.add_argument("--chunk", type=int, default=2_000)
    parser.add_argument("--manager-steps", default="8,64",
                        help="requests per scheduler step in the manager-cost section")
    parser.add_argument("--sides", default=",".join(s.name for s in SIDES),
                        type=lambda text: text.split(","),
                        help="which managers the cost section runs (comma-separated; the "
                        "first is the baseline): " + ", ".join(s.name for s in SIDES))
    parser.add_argument("--batch-interval", type=float, default=None,
                        help="the publishers' batch_interval (s) in the cost section "
                        "(default: the publisher's default)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="time the loop thread's CPU time (default; robust on a shared "
                        "box) or wall time")
    parser.add_argument("--no-events", action="store_true")
    parser.add_argument("--no-encode", action="store_true")
    parser.add_argument("--encode-rounds", type=int, default=10)
    parser.add_argument("--no-manager", action="store_true")
    parser.add_argument("--consume", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--expect", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--idle", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.consume:
        return consume(args.consume, args.expect, args.idle)
    print(f"# bench_kv_events  python {platform.python_version()}  nproc {os.cpu_count()}  "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    t0 = time.perf_counter()
    if not args.no_events:
        events_section(args)
    if not args.no_encode:
        encode_section(args)
    if not args.no_manager:
        headline = {}
        for per_step in map(int, args.manager_steps.split(",")):
            headline[per_step] = aiokvo.run(manager_section(args, per_step))
        print("\n# The publisher's cost to the loop (KVEventPublisher vs nobody subscribed, "
              "median of paired rounds):")
        for per_step, costs in headline.items():
            print(f"#   {per_step} requests per step: "
                  + ", ".join(f"{name} {cost * 100:+.1f}%" for name, cost in costs.items()))
    print(f"\n# total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
