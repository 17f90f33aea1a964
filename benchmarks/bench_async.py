"""Benchmarks for the async layer, each measured side by side in one run.

1. Wake-up latency: from a source being completed by another thread to the
   awaiting coroutine resuming, per poller mode and loop, with the process's
   CPU use while waiting and while idle.
2. Async overhead: one-page (4 KiB) transfers per second through
   ``transfer_async`` + ``await``, against doing the same copy directly and
   synchronously.
3. Host-copy bandwidth, from ``benchmarks/bench_host_copy.py`` when present.

Run with no arguments (``make bench``); ``--quick`` shrinks everything,
``--markdown PATH`` also writes the tables to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch
import uvloop

from aiokvo.handlers.base import SingleDirectionHandler, Submission
from aiokvo.runtime.poller import EventPoller, PollerMode
from aiokvo.runtime.sources import HostEvent
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}
MODES: tuple[PollerMode, ...] = ("spin", "adaptive", "thread")
PAGE = 4096
LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def run_on(loop_name: str, coro: Coroutine[Any, Any, Any]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        try:
            return runner.run(coro)
        finally:
            poller = EventPoller.existing(runner.get_loop())
            if poller is not None:
                poller.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------- 1. wake-up
class _Setter:
    """A Python thread that completes sources after a delay, stamping the moment.

    This models the host backend, whose worker threads need the GIL to
    signal completion.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[HostEvent, float] | None] = queue.SimpleQueue()
        self.stamps: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            source, delay = job
            time.sleep(delay)
            self.stamps.append(time.perf_counter())
            source.set()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class WaitOnlyHostEvent(HostEvent):
    """A HostEvent with its ``notify_when_done`` hidden, so thread mode must park a
    waiter thread in ``synchronize()`` (as for a CUDA event) — the "thread" completer."""

    notify_when_done = None  # type: ignore[assignment]


class DeadlineSource:
    """Completes at a point in time with no Python involved (models a device event)."""

    __slots__ = ("deadline",)

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def query(self) -> bool:
        return time.perf_counter() >= self.deadline

    def synchronize(self) -> None:
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


async def _wakeups(
    mode: PollerMode, n: int, delay: float, completer: str, spin_budget: float
) -> tuple[list[float], float, float, float]:
    """Latencies (s), mean cycle overhead (s), CPU while waiting, CPU while idle."""
    poller = EventPoller(mode=mode, spin_budget=spin_budget)
    setter = _Setter()
    stamps: list[float] = []
    resumed: list[float] = []

    async def once(record: bool) -> None:
        if completer in ("thread", "notify"):
            source = WaitOnlyHostEvent() if completer == "thread" else HostEvent()
            future = poller.watch("bench", source)
            setter.jobs.put((source, delay))
            await future
        else:
            deadline = time.perf_counter() + delay
            await poller.watch("bench", DeadlineSource(deadline))
            if record:
                stamps.append(deadline)
        if record:
            resumed.append(time.perf_counter())

    for _ in range(20):  # warm up threads and caches
        await once(False)
    setter.stamps.clear()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        await once(True)
    wall = time.perf_counter() - wall0
    busy = (time.process_time() - cpu0) / wall
    setter.stop()
    if completer in ("thread", "notify"):
        stamps = setter.stamps
    latencies = [r - s for r, s in zip(resumed, stamps, strict=True)]
    await asyncio.sleep(0.05)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.sleep(1.0)
    idle = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    return latencies, wall / n - delay, busy, idle


def bench_wakeup(quick: bool) -> None:
    emit("## 1. Wake-up latency (source completes -> awaiting coroutine resumes)")
    emit()
    emit(
        "`completer=thread`: a Python thread sleeps `delay`, then sets a wait-only HostEvent "
        "(the host backend's case; it needs the GIL). `completer=notify`: the same, "
        "with the real HostEvent, which wakes the poller itself (`NotifyingSource`), "
        "so thread mode needs no waiter thread. "
        "`completer=deadline`: the source "
        "becomes complete `delay` after submission with no Python involved (a device "
        "event's case; thread mode's `synchronize()` sleeps until the deadline). "
        "`cycle` is wall time per round trip minus `delay`: it also shows how much the "
        "waiting starves the completing thread. `adaptive` spins for 200 us, then uses "
        "1 ms timers."
    )
    emit()
    emit(
        "| loop | completer | mode | delay | n | p50 us | p99 us | cycle us "
        "| CPU while waiting | CPU idle |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|")
    cases: list[tuple[str, PollerMode, float]] = [
        ("thread", "spin", 0.0),
        ("thread", "adaptive", 0.0),
        ("thread", "thread", 0.0),
        ("thread", "adaptive", 0.002),
        ("thread", "thread", 0.002),
        ("notify", "thread", 0.0),
        ("notify", "thread", 0.002),
        ("deadline", "spin", 0.0001),
        ("deadline", "adaptive", 0.0001),
        ("deadline", "thread", 0.0001),
        ("deadline", "adaptive", 0.002),
        ("deadline", "thread", 0.002),
    ]
    for loop_name in LOOPS:
        for completer, mode, delay in cases:
            n = (200 if quick else 1000) if delay < 0.001 else (50 if quick else 200)
            lat, cycle, busy, idle = run_on(loop_name, _wakeups(mode, n, delay, completer, 200e-6))
            emit(
                f"| {loop_name} | {completer} | {mode} | {delay * 1e3:g} ms | {n} | "
                f"{pct(lat, 0.5) * 1e6:.1f} | {pct(lat, 0.99) * 1e6:.1f} | "
                f"{cycle * 1e6:.1f} | {busy * 100:.1f}% | {idle * 100:.2f}% |"
            )
    emit()


# ---------------------------------------------------------- 2. async overhead
class InlineCopyHandler(SingleDirectionHandler):
    """Copies the page inside ``_submit``: what is left is pure async overhead."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, mode: PollerMode) -> None:
        super().__init__(("GPU", "CPU"), poller_mode=mode, max_buffered=0)
        self.src, self.dst = src, dst

    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        src_spec, dst_spec = spec
        s = int(src_spec.block_ids[0])  # type: ignore[attr-defined]
        d = int(dst_spec.block_ids[0])  # type: ignore[attr-defined]
        self.dst[d].copy_(self.src[s])
        return Submission(_DONE, PAGE, lane=self)


class _Done:
    """A source that is already complete (the copy ran inline)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _Done()


def make_host_handler(
    src: torch.Tensor, dst: torch.Tensor, mode: PollerMode
) -> SingleDirectionHandler | None:
    """The real host handler (another module), or None if it is not there yet."""
    try:
        from aiokvo.handlers.host import HostOffloadingHandler
        from aiokvo.layout import CanonicalKVCaches

        caches = CanonicalKVCaches.from_block_tensors([[src]])
        return HostOffloadingHandler(
            caches,
            [dst],
            block_size_factor=1,
            gpu_to_cpu=True,
            poller_mode=mode,
            max_buffered=0,
        )
    except Exception as exc:  # missing or changed API: fall back, and say so
        emit(f"(host handler unavailable: {exc!r})")
        return None


def page_specs(n_blocks: int, count: int) -> list[TransferSpec]:
    return [
        (GPULoadStoreSpec([i % n_blocks], [1], [0]), CPULoadStoreSpec([(i * 7) % n_blocks]))
        for i in range(count)
    ]


async def _sequential(handler: SingleDirectionHandler, specs: list[TransferSpec]) -> float:
    t0 = time.perf_counter()
    for job, spec in enumerate(specs):
        result = await handler.transfer_async(job, spec)
        assert result.success, result.error
    rate = len(specs) / (time.perf_counter() - t0)
    await handler.aclose()
    return rate


async def _pipelined(
    handler: SingleDirectionHandler, specs: list[TransferSpec], window: int
) -> float:
    t0 = time.perf_counter()
    tasks = []
    for job, spec in enumerate(specs):
        tasks.append(handler.transfer_async(job, spec))
        if len(tasks) >= window:
            result = await tasks.pop(0)
            assert result.success, result.error
    for task in tasks:
        assert (await task).success
    rate = len(specs) / (time.perf_counter() - t0)
    await handler.aclose()
    return rate


def direct_copies_per_s(src: torch.Tensor, dst: torch.Tensor, specs: list[TransferSpec]) -> float:
    pairs = [
        (int(s.block_ids[0]), int(d.block_ids[0]))  # type: ignore[attr-defined]
        for s, d in specs
    ]
    t0 = time.perf_counter()
    for s, d in pairs:
        dst[d].copy_(src[s])
    return len(pairs) / (time.perf_counter() - t0)


def bench_overhead(quick: bool) -> None:
    emit("## 2. Async overhead: one 4 KiB page per transfer")
    emit()
    n_blocks, count, window = 1024, (4000 if quick else 20000), 64
    src = torch.randint(-128, 127, (n_blocks, PAGE), dtype=torch.int8)
    dst = torch.zeros(n_blocks, PAGE, dtype=torch.int8)
    specs = page_specs(n_blocks, count)
    direct = direct_copies_per_s(src, dst, specs)
    emit(f"Direct synchronous `dst[j].copy_(src[i])`: **{direct:,.0f} copies/s** (baseline)")
    emit()
    emit(
        "`inline` = a handler whose copy runs inside `transfer_async` (pure async "
        "overhead); `host` = the real `HostOffloadingHandler` (planning on the loop, "
        "the copy on its dispatch thread, completion through `HostEvent` and the poller). "
        f"`pipelined` keeps {window} transfers in flight; `sequential` awaits each."
    )
    emit()
    emit("| loop | mode | handler | sequential /s | pipelined /s | pipelined vs direct |")
    emit("|---|---|---|---|---|---|")
    for loop_name in LOOPS:
        for mode in MODES:
            for kind in ("inline", "host"):

                def build(kind: str = kind, mode: PollerMode = mode) -> Any:
                    if kind == "inline":
                        return InlineCopyHandler(src, dst, mode)
                    return make_host_handler(src, dst, mode)

                probe = build()
                if probe is None:
                    continue
                run_on(loop_name, probe.aclose())

                async def seq(build: Callable[[], Any] = build) -> float:
                    return await _sequential(build(), specs[: count // 4])

                async def pipe(build: Callable[[], Any] = build) -> float:
                    return await _pipelined(build(), specs, window)

                seq_rate = run_on(loop_name, seq())
                pipe_rate = run_on(loop_name, pipe())
                emit(
                    f"| {loop_name} | {mode} | {kind} | {seq_rate:,.0f} | "
                    f"{pipe_rate:,.0f} | {pipe_rate / direct:.2f}x |"
                )
    emit()


# ------------------------------------------------------------ 3. host copies
def bench_host_copy(quick: bool) -> None:
    path = Path(__file__).with_name("bench_host_copy.py")
    emit("## 3. Host-copy bandwidth")
    emit()
    if not path.exists():
        emit("(benchmarks/bench_host_copy.py is not there yet: skipped)")
        return
    spec = importlib.util.spec_from_file_location("bench_host_copy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--quick"] if quick else [])


# ------------------------------------------------------------------- driver
def machine() -> str:
    try:
        model = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in model if "Model name" in ln), "?")
    except OSError:
        name = platform.processor() or "?"
    return (
        f"{os.cpu_count()} CPUs ({name}), Python {platform.python_version()}, "
        f"uvloop {uvloop.__version__}, torch {torch.__version__}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument(
        "--only", choices=("wakeup", "overhead", "host"), action="append", help="sections"
    )
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    args = parser.parse_args(argv)
    emit(f"# bench_async — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    emit()
    emit(f"Machine: {machine()}; load average {os.getloadavg()[0]:.2f} at start")
    emit(f"Command: `python benchmarks/bench_async.py {' '.join(argv or sys.argv[1:])}`")
    emit()
    sections = args.only or ["wakeup", "overhead", "host"]
    if "wakeup" in sections:
        bench_wakeup(args.quick)
    if "overhead" in sections:
        bench_overhead(args.quick)
    if args.markdown is not None:
        args.markdown.write_text("\n".join(LINES) + "\n")
    if "host" in sections:
        bench_host_copy(args.quick)


if __name__ == "__main__":
    main()
