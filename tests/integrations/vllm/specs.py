"""Out-of-tree specs the tests load through vLLM's ``spec_module_path``.

``NativeCPUOffloadingSpec``: vLLM's own CPU spec (its manager, policies and
stats), with a worker that runs on the CPU (vLLM's refuses a CPU platform),
for the benchmark's native side.

``FakeCudaAiokvoOffloadingSpec``: aiokvo's spec on its CUDA backend, driven by
the fake CUDA driver (the "GPU" tensors are the harness's CPU tensors).

``SlowCopyAiokvoOffloadingSpec``: aiokvo's spec whose host copies take
``slow_copy_seconds`` (the handlers' ``copy_fn`` seam), or last
``slow_copy_steps`` engine steps (:data:`COPY_STEPS`), so stores are still
in flight a step or two later: lookups see HIT_PENDING, reallocated blocks
need flush fences. ``FailingCopyAiokvoOffloadingSpec``: every copy of
``fail_copies`` kind (store or load) fails.

``ShadowOffloadingSpec``: aiokvo's spec whose manager sends every call to
aiokvo's manager *and* to vLLM's ``CPUOffloadingManager`` with the same
arguments, compares every answer (lookups, keys to store, evictions, block
ids, events, stats), records each difference, and answers with aiokvo's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import OffloadingManager, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from aiokvo.device.fake import FakeDriver
from aiokvo.handlers.cuda.pair import make_cuda_handlers
from aiokvo.handlers.host import HostCopy, apply_host_copies
from aiokvo.integrations.vllm import AiokvoOffloadingManager, AiokvoOffloadingSpec
from aiokvo.offloading_spec import CPUOffloadingSpec as AiokvoCPUOffloadingSpec
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

SHADOWS: list[ShadowManager] = []
"""Every shadow manager made in this process, newest last."""


class TorchCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """GPU (a CPU tensor here) <-> CPU chunks with torch indexing, inline at submission.

    Results are reported at the next ``get_finished``, in submission order.
    """

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int) -> None:
        self.bpc = blocks_per_chunk
        self.gpu = [t.tensor for t in kv_caches.tensors]
        self.page = [t.page_size_bytes for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.cpu = [torch.zeros((num_chunks, blocks_per_chunk * p), dtype=torch.int8)
                    for p in self.page]
        self.num_chunks = num_chunks
        self._done: deque[TransferResult] = deque()

    def _copy(self, store: bool, gpu_spec: Any, cpu_spec: Any) -> int:
        gpu_ids, cpu_ids = np.asarray(gpu_spec.block_ids), np.asarray(cpu_spec.block_ids)
        nbytes = g_off = c_off = 0
        for g, (n, first) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices,
                                           strict=True)):
            if n == 0:
                continue
            skip = first % self.bpc
            chunks = cpu_ids[c_off : c_off + -(-(n + skip) // self.bpc)].astype(np.int64)
            flat = (chunks[:, None] * self.bpc + np.arange(self.bpc)).ravel()[skip : skip + n]
            gi = torch.from_numpy(gpu_ids[g_off : g_off + n].astype(np.int64))
            ci = torch.from_numpy(flat)
            for ref in self.refs[g]:
                t, size = ref.tensor_idx, ref.page_size_bytes
                cpu = self.cpu[t].view(self.num_chunks * self.bpc, self.page[t])
                if store:
                    cpu[ci, :size] = self.gpu[t][gi, :size]
                else:
                    self.gpu[t][gi, :size] = cpu[ci, :size]
                nbytes += n * size
            g_off += n
            c_off += len(chunks)
        return nbytes

    def _submit(self, job_id: int, store: bool, gpu_spec: Any, cpu_spec: Any) -> bool:
        t0 = time.perf_counter()
        size = self._copy(store, gpu_spec, cpu_spec)
        self._done.append(TransferResult(job_id, True, size, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id, True, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id, False, dst_spec, src_spec)

    def get_finished(self) -> list[TransferResult]:
        done = list(self._done)
        self._done.clear()
        return done

    def wait(self, job_ids: set[int]) -> None:
        return


class NativeCPUOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's native CPU offloading, with a worker that runs without CUDA."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TorchCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


class StepGate:
    """Engine steps as slow copies see them, so that how long a copy stays in flight
    does not depend on how fast the machine runs the steps.

    A copy held at step ``s`` goes on once the harness has begun step ``s + n``,
    or at once while the engine waits for copies (a flush fence, a reset) or
    once the gate is opened (closing): those waits would otherwise never end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._step = 0
        self._waits = 0  # engine waits under way
        self._open = False

    def reset(self) -> None:
        with self._cond:
            self._step, self._waits, self._open = 0, 0, False

    def tick(self) -> None:
        with self._cond:
            self._step += 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def engine_waits(self) -> Iterator[None]:
        with self._cond:
            self._waits += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._waits -= 1

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def hold(self, steps: int) -> None:
        with self._cond:
            until = self._step + steps
            if not self._cond.wait_for(
                lambda: self._open or self._waits > 0 or self._step >= until, timeout=120
            ):
                raise TimeoutError(f"a copy held for {steps} steps: nothing stepped in 120 s")


COPY_STEPS = StepGate()
"""The gate of ``slow_copy_steps`` copies; the harness ticks, fences and opens it."""


class SlowCopyAiokvoOffloadingSpec(AiokvoOffloadingSpec):  # type: ignore[misc]
    default_delay = 0.05

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        steps = int(self.extra_config.get("slow_copy_steps", 0))
        delay = float(self.extra_config.get("slow_copy_seconds", self.default_delay))
        if steps > 0:

            def copy_after_steps(copies: Any) -> None:
                COPY_STEPS.hold(steps)
                apply_host_copies(copies)

            self.handler_options["copy_fn"] = copy_after_steps
            return
        if delay <= 0:
            return

        def slow_copy(copies: Any) -> None:
            time.sleep(delay)
            apply_host_copies(copies)

        self.handler_options["copy_fn"] = slow_copy


class FailingCopyAiokvoOffloadingSpec(AiokvoOffloadingSpec):  # type: ignore[misc]
    """Copies of kind ``fail_copies`` ("store", "load" or "all") always fail;
    ``fail_first`` (default: all of them) limits it to that many failed copies."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.failing = str(self.extra_config.get("fail_copies", "store"))
        self.left = int(self.extra_config.get("fail_first", 1 << 30))
        self.failed = 0
        self._pool_pointers: set[int] = set()
        self.handler_options["copy_fn"] = self._copy

    def _copy(self, copies: Sequence[HostCopy]) -> None:
        store = bool(copies) and int(copies[0].dst.ctypes.data) in self._pool_pointers
        if self.left > 0 and self.failing in ("all", "store" if store else "load"):
            self.left -= 1
            self.failed += 1
            raise OSError(f"injected {'store' if store else 'load'} failure")
        apply_host_copies(copies)

    def get_worker(self, kv_caches: Any) -> Any:
        worker = super().get_worker(kv_caches)
        self._pool_pointers = {int(t.data_ptr()) for t in worker.cpu_pool}
        return worker


class FakeCudaCPUOffloadingSpec(AiokvoCPUOffloadingSpec):  # type: ignore[misc]
    """aiokvo's CPU spec with CUDA handlers on :class:`FakeDriver`."""

    def get_handlers(self, kv_caches: Any) -> Iterator[Any]:
        if getattr(self, "_fake", None) is None:
            self._driver = FakeDriver()
            self._fake = make_cuda_handlers(
                kv_caches, block_size_factor=self.config.block_size_factor,
                num_cpu_blocks=self.config.num_cpu_blocks, driver=self._driver,
                **self.handler_options,
            )  # fmt: skip
        return iter([
            (GPULoadStoreSpec, CPULoadStoreSpec, self._fake.gpu_to_cpu),
            (CPULoadStoreSpec, GPULoadStoreSpec, self._fake.cpu_to_gpu),
        ])  # fmt: skip

    async def aclose(self) -> None:
        fake, self._fake = getattr(self, "_fake", None), None
        if fake is not None:
            await fake.aclose()
            self._driver.close()
        await super().aclose()


class FakeCudaAiokvoOffloadingSpec(AiokvoOffloadingSpec):  # type: ignore[misc]
    inner_spec_class = FakeCudaCPUOffloadingSpec


# ------------------------------------------------------------------- the shadow


def _ids(spec: Any) -> list[int]:
    return [int(i) for i in np.asarray(spec.block_ids).tolist()]


def _store(out: Any) -> Any:
    if out is None:
        return None
    return list(out.keys_to_store), _ids(out.store_spec), list(out.evicted_keys)


def _events(events: Any) -> list[tuple[tuple[bytes, ...], Any, bool]]:
    return [(tuple(e.keys), e.medium, e.removed) for e in events]


def _stats(stats: Any) -> dict[str, float]:
    # The keys both emit; aiokvo's own failure counter has no native twin.
    reduced = {} if stats is None else stats.reduce()
    return {k: v for k, v in reduced.items() if "aiokvo" not in k}


class ShadowManager(OffloadingManager):  # type: ignore[misc]
    """Both managers, one call at a time; see the module docstring."""

    def __init__(self, aiokvo: AiokvoOffloadingManager, native: CPUOffloadingManager) -> None:
        self.aiokvo = aiokvo
        self.native = native
        self.calls = 0
        self.compared: dict[str, int] = {}
        self.diffs: list[str] = []
        self.first_diff: tuple[str, Any, Any] | None = None
        SHADOWS.append(self)

    @property
    def aiokvo_manager(self) -> Any:
        return self.aiokvo.aiokvo_manager

    def _same(self, name: str, mine: Any, theirs: Any) -> None:
        if self.first_diff is not None:
            return  # past the first difference only aiokvo is driven (see _both)
        self.compared[name] = self.compared.get(name, 0) + 1
        if mine != theirs and self.first_diff is None:
            self.first_diff = (name, mine, theirs)
        if mine != theirs and len(self.diffs) < 50:
            self.diffs.append(f"call {self.calls} {name}: aiokvo {mine!r} != vLLM {theirs!r}")

    def _both(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.calls += 1
        mine = getattr(self.aiokvo, name)(*args, **kwargs)
        if self.first_diff is not None:
            # Past a difference the two pools hold different blocks: vLLM's manager,
            # driven on by aiokvo's answers, would assert on a key it evicted and
            # aiokvo kept (how soon depends on when the worker's copies end).
            return mine, mine
        return mine, getattr(self.native, name)(*args, **kwargs)

    def on_new_request(self, req_context: Any) -> Any:
        mine, _ = self._both("on_new_request", req_context)
        return mine

    def lookup(self, key: bytes, req_context: Any) -> Any:
        mine, theirs = self._both("lookup", key, req_context)
        self._same("lookup", mine.name, theirs.name)
        return mine

    def get_load_source(self, key: bytes, req_context: Any) -> Any:
        mine, theirs = self._both("get_load_source", key, req_context)
        self._same("get_load_source", mine, theirs)
        return mine

    def prepare_load(self, keys: Collection[bytes], req_context: Any) -> Any:
        mine, theirs = self._both("prepare_load", keys, req_context)
        self._same("prepare_load", _ids(mine), _ids(theirs))
        return mine

    def touch(self, keys: Collection[bytes], req_context: Any) -> None:
        self._both("touch", keys, req_context)

    def complete_load(self, keys: Collection[bytes], req_context: Any) -> None:
        self._both("complete_load", keys, req_context)

    def prepare_store(self, keys: Collection[bytes], req_context: Any) -> Any:
        mine, theirs = self._both("prepare_store", keys, req_context)
        self._same("prepare_store", _store(mine), _store(theirs))
        return mine

    def complete_store(self, keys: Collection[bytes], req_context: Any,
                       success: bool = True) -> None:
        self._both("complete_store", keys, req_context, success)

    def on_request_finished(self, req_context: Any) -> None:
        self._both("on_request_finished", req_context)

    def take_events(self) -> Any:
        self.calls += 1
        mine = list(self.aiokvo.take_events())
        theirs = mine if self.first_diff is not None else list(self.native.take_events())
        self._same("take_events", _events(mine), _events(theirs))
        return mine

    def on_schedule_end(self, context: Any) -> None:
        self._both("on_schedule_end", context)

    def has_pending_work(self) -> bool:
        mine, theirs = self._both("has_pending_work")
        self._same("has_pending_work", mine, theirs)
        return bool(mine)

    def reset_cache(self) -> None:
        self._both("reset_cache")

    def get_stats(self) -> Any:
        mine, theirs = self._both("get_stats")
        self._same("get_stats", _stats(mine), _stats(theirs))
        return mine

    def shutdown(self) -> None:
        self._both("shutdown")


class ShadowOffloadingSpec(SlowCopyAiokvoOffloadingSpec):  # type: ignore[misc]
    """aiokvo's spec with :class:`ShadowManager` as its manager (and, with
    ``slow_copy_seconds``, slow copies)."""

    default_delay = 0.0

    def get_manager(self) -> Any:
        if getattr(self, "_shadow", None) is None:
            extra = self.extra_config
            native = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=extra.get("eviction_policy", "lru"),
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(extra.get("store_threshold", 0)),
                max_tracker_size=int(extra.get("max_tracker_size", 64_000)),
            )
            self._shadow = ShadowManager(super().get_manager(), native)
        return self._shadow
